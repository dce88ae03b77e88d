"""Every way in reaches the workers at once: a team's own app, and ratchet's, on Redis and RabbitMQ.

The team's app is a ``proj`` package written here (its own ``celery.py`` and
``tasks.py``, one task of its own, ``tasks.install(app)``), run as
``celery -A proj worker``; the same matrix runs on ``celery -A worker worker``. No
beat runs anywhere: a run whose message went where no worker reads never moves, so
each case completes only if what its sender sent reached the worker — and none of
its events is a sweeper's ``run.resumed`` (but the one run a sweep is asked to resume,
whose resume must reach the worker too). One worker per (app, broker) serves every
sender of the matrix, all sending at once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery
from kombu import Connection, Queue

from runtime.models import RunStatus
from store.runs.redis import RedisRunStore
from tasks import messages
from tasks.context import Context
from tasks.recovery import sweep_orphans
from tasks.settings import QueueType, Settings
from tasks.start import create_run
from tests.console.test_console_pages import TOKEN, act
from tests.helpers import call, turn, write_agent
from tests.workers import (
    ROOT,
    WorkerProcess,
    WorkerProcesses,
    redis_context,
    run_status,
    wait_for,
    worker_env,
)
from worker import client
from worker.api import Ratchet
from worker.app import make_app
from worker.console.app import make_app as make_console

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROJ_CELERY = '''\
"""A team's Celery app, with ratchet added to it (docs/celery.md)."""
import os

from celery import Celery
from kombu import Exchange, Queue

import tasks

app = Celery("proj", broker=os.environ["PROJ_BROKER_URL"], include=["proj.tasks"])
app.conf.task_queues = (Queue("proj.work", Exchange("proj.work"), routing_key="proj.work"),)
app.conf.task_routes = {"proj.touch": {"queue": "proj.work"}}
tasks.install(app)
'''
PROJ_TASKS = """\
from pathlib import Path

from proj.celery import app


@app.task(name="proj.touch")
def touch(path):
    Path(path).write_text("touched")
"""

LOOKUP = [turn("Looking.", call("lookup_order", order_id="B2")), turn("B2 is on its way.")]
ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]


def write_proj(directory: Path) -> Path:
    """The team's package ``proj`` under ``directory``; returns ``directory``."""
    package = directory / "proj"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from proj.celery import app\n\n__all__ = ['app']\n")
    (package / "celery.py").write_text(PROJ_CELERY)
    (package / "tasks.py").write_text(PROJ_TASKS)
    return directory


@dataclass
class Fleet:
    """One worker of ``app_name`` on ``broker_url``, and what each sender needs to reach it."""

    app_name: str
    """``proj`` (the team's) or ``worker`` (ratchet's own)."""
    broker_url: str
    store_url: str
    ctx: Context
    worker: WorkerProcess
    sender_app: Any
    """The app in-process senders (API, console) go through: the one the worker runs."""
    cli_env: dict[str, str]
    agents: Path
    queue_type: QueueType
    """RabbitMQ: how ratchet's queues are declared (``classic`` on other brokers)."""

    def agent(self, script: list[dict[str, Any]], name: str) -> str:
        """The agent ``name`` (written by the fixture, before any sender runs)."""
        path = self.agents / f"{name}.toml"
        assert path.exists(), path
        return str(path)

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ratchet", *args],
            env={**self.cli_env, **env},
            cwd=self.agents,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def completes_by_the_worker_alone(self, run_id: str) -> None:
        wait_for(
            f"run {run_id} completes",
            lambda: (
                (record := self.ctx.runs.get(run_id)) is not None
                and record.status == RunStatus.COMPLETED
            ),
            timeout_s=45,
        )
        kinds = [event.type for event in self.ctx.runs.events(run_id)]
        assert "run.resumed" not in kinds, kinds

    def suspended(self, run_id: str) -> int:
        wait_for(
            f"run {run_id} waits for a person",
            lambda: (
                (record := self.ctx.runs.get(run_id)) is not None and record.status.is_suspended
            ),
            timeout_s=45,
        )
        record = self.ctx.runs.get(run_id)
        assert record is not None and record.suspension is not None
        return record.suspension.seq

    def ask(self) -> str:
        """A run started through the API, waiting for a person's answer; its id."""
        run_id = Ratchet(self.ctx).start(self.agent(ASK, "ask"), "refund my order")
        self.suspended(run_id)
        return run_id


def _import_proj(root: Path, broker_url: str) -> Any:
    """The team's app, imported in this process as its own modules are (PROJ_BROKER_URL)."""
    for name in [name for name in sys.modules if name == "proj" or name.startswith("proj.")]:
        del sys.modules[name]
    os.environ["PROJ_BROKER_URL"] = broker_url
    sys.path.insert(0, str(root))
    try:
        import proj  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(root))
        del os.environ["PROJ_BROKER_URL"]
    return proj.app


@pytest.fixture(
    params=[
        ("proj", "redis"),
        ("proj", "rabbitmq"),
        ("worker", "redis"),
        ("worker", "rabbitmq"),
        ("worker", "rabbitmq-quorum"),
    ],
    ids=[
        "proj-redis",
        "proj-rabbitmq",
        "worker-redis",
        "worker-rabbitmq",
        "worker-rabbitmq-quorum",
    ],
)
def fleet(request: pytest.FixtureRequest, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """One worker of the app on the broker (stores: the test's Redis database), and no beat.

    ``rabbitmq-quorum``: ratchet's queues are quorum queues (RATCHET_TASK_DEFAULT_QUEUE_TYPE),
    for the workers and for every sender.
    """
    app_name, broker = request.param
    rabbitmq = broker.startswith("rabbitmq")
    broker_url = request.getfixturevalue("rabbitmq_vhost") if rabbitmq else redis_url
    queue_type: QueueType = "quorum" if broker == "rabbitmq-quorum" else "classic"
    team = write_proj(tmp_path / "team")
    base = worker_env(redis_url, tmp_path / "refunds.ledger", tmp_path / "data")
    if queue_type == "quorum":
        base["RATCHET_TASK_DEFAULT_QUEUE_TYPE"] = queue_type
    base["PYTHONPATH"] = f"{team}{os.pathsep}{ROOT}"
    queues = "ratchet.turns,ratchet.control"
    if app_name == "proj":
        # The team's workers know the broker from their app alone.
        del base["RATCHET_BROKER_URL"]
        base["PROJ_BROKER_URL"] = broker_url
        queues += ",proj.work"
    else:
        base["RATCHET_BROKER_URL"] = broker_url
    processes = WorkerProcesses(base, tmp_path)
    before = messages._sending_app
    sender: Any = None
    ctx = redis_context(redis_url)
    try:
        worker = processes.start(
            "-Q", queues, "--pool", "threads", "--concurrency", "8", app=app_name
        )
        if app_name == "proj":
            sender = _import_proj(team, broker_url)
        else:
            sender = make_app(Settings(broker_url=broker_url, task_default_queue_type=queue_type))
            messages.send_through(sender)
        write_agent(tmp_path / "agents", LOOKUP, name="lookup")
        write_agent(tmp_path / "agents", ASK, name="ask")
        wait_for("the worker is ready", lambda: "ready." in worker.log(), timeout_s=60)
        yield Fleet(
            app_name, broker_url, redis_url, ctx, worker, sender, base, tmp_path / "agents",
            queue_type,
        )  # fmt: skip
    finally:
        processes.stop_all()
        messages.send_through(before)
        ctx.close()
        if sender is not None:
            sender.close()


# --- the matrix: each sender, one run each --------------------------------------------


def cli_start(fleet: Fleet) -> str:
    run_id = f"cli-start-{uuid.uuid4().hex[:8]}"
    how = ["--app", "proj"] if fleet.app_name == "proj" else []
    started = fleet.cli(*how, "runs", "start", fleet.agent(LOOKUP, "lookup"), "--input", "B2",
                        "--run-id", run_id)  # fmt: skip
    assert started.returncode == 0, started.stderr
    return run_id


def cli_start_through_ratchets_app(fleet: Fleet) -> str:
    """Without --app: the CLI's own app (RATCHET_BROKER_URL) reads the same table."""
    run_id = f"cli-own-{uuid.uuid4().hex[:8]}"
    started = fleet.cli("runs", "start", fleet.agent(LOOKUP, "lookup"), "--input", "B2",
                        "--run-id", run_id, RATCHET_BROKER_URL=fleet.broker_url)  # fmt: skip
    assert started.returncode == 0, started.stderr
    return run_id


def cli_continue(fleet: Fleet) -> str:
    run_id = fleet.ask()
    # RATCHET_APP, the environment's way to name the app (ratchet's own: RATCHET_BROKER_URL)
    env = {"RATCHET_APP": "proj"} if fleet.app_name == "proj" else {}
    answered = fleet.cli("runs", "continue", run_id, "--input", "Order B2", **env)
    assert answered.returncode == 0, answered.stderr
    return run_id


def console_answer(fleet: Fleet) -> str:
    run_id = fleet.ask()

    async def answer() -> None:
        transport = httpx.ASGITransport(app=make_console(Ratchet(fleet.ctx), TOKEN))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            assert (await http.post("/login", data={"token": TOKEN})).status_code == 303
            response = await act(http, run_id, "answer", input="Order B2")
            assert response.status_code in (200, 303), response.text[-1500:]

    asyncio.run(answer())
    return run_id


def api_start(fleet: Fleet) -> str:
    return Ratchet(fleet.ctx).start(fleet.agent(LOOKUP, "lookup"), "B2")


def client_start(fleet: Fleet) -> str:
    run_id = f"client-{uuid.uuid4().hex[:8]}"
    shop = Celery("shop", broker=fleet.broker_url, set_as_current=False)
    try:
        client.route(
            shop, Settings(broker_url=fleet.broker_url, task_default_queue_type=fleet.queue_type)
        )
        client.start_run(shop, fleet.agent(LOOKUP, "lookup"), "B2", run_id=run_id)
    finally:
        shop.close()
    return run_id


def plain_json_answer(fleet: Fleet) -> str:
    run_id = fleet.ask()
    body = {"run_id": run_id, "input": "Order B2", "continuation_id": f"json-{run_id}"}
    # A producer that declares the queue declares it as the workers do: RabbitMQ 3.10
    # refuses a quorum queue declared again without its x-queue-type.
    arguments = {"x-queue-type": "quorum"} if fleet.queue_type == "quorum" else None
    with Connection(fleet.broker_url) as connection:
        connection.Producer().publish(
            body,
            exchange="",
            routing_key="ratchet.continuations",
            declare=[Queue("ratchet.continuations", queue_arguments=arguments)],
            serializer="json",
            retry=True,
        )
    return run_id


SENDERS: dict[str, Callable[[Fleet], str]] = {
    "cli-start": cli_start,
    "cli-start-own-app": cli_start_through_ratchets_app,
    "cli-continue": cli_continue,
    "console-answer": console_answer,
    "api-start": api_start,
    "client-start": client_start,
    "plain-json-continuation": plain_json_answer,
}


def sweeper_resume(fleet: Fleet) -> str:
    """A run recorded with no turn queued (its first turn lost), found by a sweep an hour on."""
    state = create_run(fleet.ctx, fleet.agent(LOOKUP, "lookup"), "B2")
    hour_later = Context(
        settings=Settings(),
        snapshots=fleet.ctx.snapshots,
        runs=RedisRunStore.from_url(
            fleet.store_url, clock=lambda: int(time.time() * 1000) + 3_600_000
        ),
    )
    try:
        # The sweep beat would send, run here to name the hour; it resumes through the app.
        assert state.run_id in sweep_orphans(hour_later)
    finally:
        hour_later.runs.close()
    return state.run_id


def test_what_each_sender_sends_is_taken_by_the_fleets_worker_at_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    # Given a worker of the app, and no beat (no sweeper to rescue a stranded message)
    # When each sender starts or answers a run of its own, all at once
    with ThreadPoolExecutor(len(SENDERS)) as pool:
        sent = {name: pool.submit(send, fleet) for name, send in SENDERS.items()}
    failed: dict[str, str] = {}
    run_ids = {}
    for name, future in sent.items():
        try:
            run_ids[name] = future.result()
        except Exception as exc:  # noqa: BLE001  (every sender's outcome is reported)
            failed[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    # Then the worker takes every turn of each run, with no resume by a sweeper
    for name, run_id in run_ids.items():
        try:
            fleet.completes_by_the_worker_alone(run_id)
        except AssertionError as exc:
            failed[name] = str(exc).splitlines()[0]
    assert not failed, "\n".join(
        [*(f"{name}: {why}" for name, why in failed.items()), fleet.worker.log()[-1500:]]
    )
    # And the sweeper's resume reaches the worker too (the one resume of its run; swept
    # once the others are done, since an hour on every run in flight is overdue)
    run_id = sweeper_resume(fleet)
    wait_for(f"run {run_id} completes", lambda: run_status(fleet.ctx, run_id).is_terminal)
    assert run_status(fleet.ctx, run_id) == RunStatus.COMPLETED
    resumed = [e.data.get("by") for e in fleet.ctx.runs.events(run_id) if e.type == "run.resumed"]
    assert resumed == ["sweeper"]
    # And on the team's app, its own task keeps working beside ratchet's
    if fleet.app_name == "proj":
        marker = tmp_path / "touched"
        fleet.sender_app.send_task("proj.touch", args=(str(marker),))
        wait_for("the team's own task ran", marker.exists)
