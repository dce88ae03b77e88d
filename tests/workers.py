"""Real Celery workers for tests: one in-process session worker, and subprocesses.

- ``session_worker``: Celery's own in-process test worker (threads pool) for
  ``session_app``, ratchet's app on the session's redis-server (database 0 is its
  broker), which what the tests send goes through.
  Tests give it their stores through ``tasks.context.set_context``.
- ``ratchet``: a per-test API over Redis stores in the test's own database, with
  that context installed for the session worker.
- ``worker_processes``: ``celery -A worker worker`` subprocesses configured only
  by environment variables, as an operator would run them; they can be SIGKILLed.
- ``rabbitmq_vhost``: an ``amqp://`` URL of a RabbitMQ virtual host of the test's
  own, on the RabbitMQ at 127.0.0.1:5672 (guest/guest), deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from runtime.models import RunStatus
from store.runs import RunRecord
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context, set_context
from tasks.messages import send_through, sending_app
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import installed_context
from tests.redis_server import RedisServer
from worker.api import Ratchet
from worker.app import make_app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_AGENT = ROOT / "examples" / "refund-desk.toml"
BROKER_DB = 0
T = TypeVar("T")


@pytest.fixture(scope="session")
def session_app(redis_server: RedisServer) -> Iterator[Celery]:
    """ratchet's app on the session's redis-server (database 0 is its broker).

    What ratchet sends outside a task goes through it for the session; the app the
    environment configures (``worker.app.app``) is left as it was built.
    """
    settings = Settings(broker_url=f"{redis_server.url}/{BROKER_DB}", visibility_timeout_s=3600)
    app = make_app(settings)
    before = sending_app()
    send_through(app)
    try:
        yield app
    finally:
        send_through(before)
        app.close()


@pytest.fixture(scope="session")
def session_worker(session_app: Celery) -> Iterator[None]:
    with start_worker(
        session_app,
        pool="threads",
        concurrency=2,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=10,
    ):
        yield


def wait_until(
    what: str, found: Callable[[], T | None], timeout_s: float = 60, poll_s: float = 0.05
) -> T:
    """Poll ``found()`` every ``poll_s`` until it returns something truthy, and return that;
    fail naming ``what`` after ``timeout_s``. Every wait of the suite is this one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = found()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {what}"
        time.sleep(poll_s)


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float = 60, poll_s: float = 0.05
) -> None:
    """Wait until ``check()`` holds; fail naming ``what`` after ``timeout_s``."""
    wait_until(what, check, timeout_s, poll_s)


def wait_for_run(
    ctx: Context, run_id: str, done: Callable[[RunRecord], bool], timeout_s: float = 60
) -> RunRecord:
    """Wait until run ``run_id``'s record satisfies ``done``, and return it."""

    def reached() -> RunRecord | None:
        record = ctx.runs.get(run_id)
        return record if record is not None and done(record) else None

    try:
        return wait_until(f"run {run_id} gets there", reached, timeout_s, poll_s=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {ctx.runs.get(run_id)}") from None


def run_status(ctx: Context, run_id: str) -> RunStatus:
    """The status of run ``run_id``, which must exist."""
    record = ctx.runs.get(run_id)
    assert record is not None, f"no run {run_id}"
    return record.status


def redis_context(url: str, **settings: object) -> Context:
    return Context(
        settings=Settings(**settings),  # type: ignore[arg-type]
        snapshots=RedisSnapshotStore.from_url(url),
        runs=RedisRunStore.from_url(url),
    )


@contextmanager
def session_ratchet(url: str, **settings: object) -> Iterator[Ratchet]:
    """An API over the Redis stores at ``url``, its context (with ``settings``) installed for
    the session's worker while the block runs; uninstalled and closed after it."""
    with closing(redis_context(url, **settings)) as context, installed_context(context):
        yield Ratchet(context)


@pytest.fixture
def ratchet(session_worker: None, redis_url: str, ledger: Path) -> Iterator[Ratchet]:
    with session_ratchet(redis_url) as api:
        yield api


@pytest.fixture
def installed(session_worker: None) -> Iterator[list[Context]]:
    """The contexts a test installs (:func:`install`) for the session's in-process worker;
    uninstalled and closed afterwards."""
    contexts: list[Context] = []
    yield contexts
    set_context(None)
    for ctx in contexts:
        ctx.close()


def install(installed: list[Context], url: str) -> Context:
    """A context on the Redis stores at ``url``, installed for the session's worker."""
    ctx = redis_context(url)
    installed.append(ctx)
    set_context(ctx)
    return ctx


def status_is(status: RunStatus) -> Callable[[RunRecord], bool]:
    """For :func:`wait_for_run`: the run is in ``status``."""
    return lambda record: record.status == status


FAILOVER_STALLS = ("min_replicas=1", "is unavailable")
"""Why a run may stall across a store's failover, waiting for an operator's resume: too few
replicas acknowledged a non-idempotent call's journal entry, or the store was unreachable
for longer than its retries while the replica was promoted. Both say to resume."""


def completed_resuming_stalls(api: Ratchet, run_ids: list[str], resumed: dict[str, int]) -> bool:
    """Whether every run completed; resumes, as an operator would, each run stalled for a
    reason of :data:`FAILOVER_STALLS`, once per stall (``resumed``: the seq each was last
    resumed at). Any other stall, or a parked run that never completes, fails the test."""
    records: list[RunRecord] = [api.get(run_id) for run_id in run_ids]
    for record in records:
        if record.status == RunStatus.STALLED and resumed.get(record.run_id) != record.last_seq:
            error = record.error or ""
            assert any(reason in error for reason in FAILOVER_STALLS), error
            assert f"ratchet runs resume {record.run_id}" in error, error
            api.resume(record.run_id)
            resumed[record.run_id] = record.last_seq
    return all(record.status == RunStatus.COMPLETED for record in records)


def logged_process(
    argv: Sequence[str], env: dict[str, str], log_path: Path, *, cwd: Path | None
) -> subprocess.Popen[bytes]:
    """``argv`` started in a process group of its own (``os.killpg`` reaches its children),
    reading nothing, its output and errors appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def running_beat(env: dict[str, str], directory: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A worker beat`` under ``env``, its schedule and log (``beat.log``) in
    ``directory``, while the block runs; SIGKILLed with its process group after it."""
    argv = [sys.executable, "-m", "celery", "-A", "worker", "beat", "--loglevel", "INFO",
            "-s", str(directory / "beat-schedule")]  # fmt: skip
    beat = logged_process(argv, env, directory / "beat.log", cwd=ROOT)
    try:
        yield beat
    finally:
        os.killpg(beat.pid, signal.SIGKILL)
        beat.wait()


@dataclass
class WorkerProcess:
    """One ``celery -A worker worker`` subprocess."""

    env: dict[str, str]
    log_path: Path
    args: tuple[str, ...] = ()
    app: str = "worker"
    """The ``-A`` argument: ratchet's app, or an application's with ratchet installed."""
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> WorkerProcess:
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "worker",
            "--loglevel",
            "INFO",
            "--without-mingle",
            "--without-gossip",
            "--hostname",
            f"w{time.monotonic_ns()}@%h",
            *self.args,
        ]
        self.process = logged_process(command, self.env, self.log_path, cwd=ROOT)
        return self

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL the worker and every pool process: a vanished machine."""
        if self.process is not None and self.process.poll() is None:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class WorkerProcesses:
    base_env: dict[str, str]
    directory: Path
    started: list[WorkerProcess] = field(default_factory=list)

    def start(self, *args: str, app: str = "worker", **env: str) -> WorkerProcess:
        log_path = self.directory / f"worker-{len(self.started)}.log"
        worker = WorkerProcess({**self.base_env, **env}, log_path, args, app).start()
        self.started.append(worker)
        return worker

    def stop_all(self) -> None:
        for worker in self.started:
            worker.kill()


def ratchet_cli(
    env: dict[str, str], *args: str, timeout_s: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``ratchet ARGS`` (``python -m worker``) in a process of its own under ``env``, as an
    operator would type it; its exit status and output, as text (``check``: it must exit 0)."""
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )


def start_example(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """``ratchet runs start`` of the example refund desk for order B2, from another process,
    waiting up to 60 s for the run to finish."""
    return ratchet_cli(
        env,
        "runs",
        "start",
        str(EXAMPLE_AGENT),
        "--input",
        "Refund order B2",
        "--wait",
        "--timeout",
        "60",
        *extra,
        timeout_s=80,
    )


def worker_env(redis_url: str, ledger: Path, data_dir: Path, **extra: str) -> dict[str, str]:
    """Environment of a worker subprocess whose broker and stores are all on ``redis_url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_BROKER_URL=redis_url,
        RATCHET_SNAPSHOT_STORE=redis_url,
        RATCHET_RUN_STORE=redis_url,
        RATCHET_DATA_DIR=str(data_dir),
        RATCHET_EXAMPLE_LEDGER=str(ledger),
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


@contextmanager
def sending_to(broker_url: str) -> Iterator[Celery]:
    """What ratchet sends outside a task goes to ``broker_url`` (through an app of its own)
    while the block runs; the app that sent before sends again after it."""
    sender, before = make_app(Settings(broker_url=broker_url)), sending_app()
    send_through(sender)
    try:
        yield sender
    finally:
        send_through(before)
        sender.close()


def run_on_workers(redis_url: str, agent: Path, text: str, timeout_s: float) -> RunRecord:
    """A run of ``agent`` created on the Redis stores at ``redis_url``, its first turn sent
    through the broker there (to worker subprocesses): its record once it stops running."""
    sender = make_app(Settings(broker_url=redis_url))
    with closing(redis_context(redis_url)) as ctx, closing(sender):
        state = create_run(ctx, agent, text)
        sender.send_task("ratchet.turn", (state.run_id, state.seq))
        return Ratchet(ctx).wait(state.run_id, timeout_s=timeout_s)


@dataclass
class SweptWorker:
    """A ``celery -A worker worker -B`` subprocess (threads, 4 at once) whose beat sweeps
    every 0.5 s, leases of 2 s: a turn a crash or failover cut off is resumed once its lease
    expires (the broker's redelivery is never the guarantee). ``ctx``: its stores."""

    ctx: Context
    process: WorkerProcess
    broker_url: str

    def start(self, agent: Path, text: str) -> str:
        """Create a run of ``agent`` on the stores and send its first turn to the worker, through
        an app of its own: one made before a broker's failover may hold a dead connection."""
        run_id = create_run(self.ctx, agent, text).run_id
        with closing(make_app(Settings(broker_url=self.broker_url))) as app:
            app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        return run_id

    def under_way(self, agent: Path, text: str, answered: int = 2) -> str:
        """:meth:`start` a run, and wait until the model answered ``answered`` of its turns."""
        run_id = self.start(agent, text)
        wait_for(
            f"run {run_id} is {answered} turns in",
            lambda: (
                sum(e.type == "model.responded" for e in self.ctx.runs.events(run_id)) >= answered
            ),
            timeout_s=30,
        )
        return run_id

    def alive(self) -> bool:
        return self.process.process is not None and self.process.process.poll() is None


@contextmanager
def swept_worker(
    tmp_path: Path, ledger: Path, broker_url: str, stores: str | None = None, **env: str
) -> Iterator[SweptWorker]:
    """A :class:`SweptWorker` on ``broker_url``, its stores on ``stores`` (else the broker's
    URL), ``env`` added to its environment; killed, and its context closed, after the block."""
    stores = stores or broker_url
    base = worker_env(broker_url, ledger, tmp_path / "data")
    base.update(
        RATCHET_RUN_STORE=stores,
        RATCHET_SNAPSHOT_STORE=stores,
        RATCHET_LEASE_S="2",
        RATCHET_SWEEP_INTERVAL_S="0.5",
        **env,
    )
    workers = WorkerProcesses(base, tmp_path)
    with closing(redis_context(stores)) as ctx:
        try:
            process = workers.start(
                "--pool", "threads", "--concurrency", "4", "-B", "-s", str(tmp_path / "beat")
            )  # fmt: skip
            yield SweptWorker(ctx, process, broker_url)
        finally:
            workers.stop_all()


@pytest.fixture
def worker_processes(redis_url: str, ledger: Path, tmp_path: Path) -> Iterator[WorkerProcesses]:
    processes = WorkerProcesses(worker_env(redis_url, ledger, tmp_path / "data"), tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The workers' broker: the test's Redis database, or a RabbitMQ vhost of its own."""
    if request.param == "redis":
        return redis_url
    url: str = request.getfixturevalue("rabbitmq_vhost")
    return url


def _rabbitmqctl(*args: str) -> list[str]:
    # RabbitMQ's own tool comes with the server the RabbitMQ tests run against.
    assert shutil.which("rabbitmqctl"), "rabbitmqctl not found: install rabbitmq-server"
    return ["rabbitmqctl", "-q", *args]


@pytest.fixture(scope="session")
def _vhosts_deleted() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """The deletions of the tests' virtual hosts, each started as its test ends.

    A ``rabbitmqctl`` call starts an Erlang VM (about 2 s): a test's name is its own
    and nothing reuses it, so the next test need not wait for the last one's to go.
    Every deletion must still have succeeded when the session ends.
    """
    deleting: list[tuple[str, subprocess.Popen[bytes]]] = []
    yield deleting
    failed = []
    for vhost, process in deleting:
        _, stderr = process.communicate(timeout=60)
        if process.returncode != 0:
            failed.append(f"{vhost}: {stderr.decode(errors='replace').strip()}")
    assert not failed, f"virtual hosts not deleted: {failed}"


@pytest.fixture
def rabbitmq_vhost(_vhosts_deleted: list[tuple[str, subprocess.Popen[bytes]]]) -> Iterator[str]:
    """A RabbitMQ virtual host of this test's own, so no other worker takes its messages."""
    vhost = f"ratchet-test-{uuid.uuid4().hex[:12]}"
    # The virtual host and guest's permissions on it in one call (RabbitMQ's definitions
    # format, which only adds what it names), not two. On standard input: the server
    # may not read the test's temporary directory.
    permissions = {"user": "guest", "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
    subprocess.run(
        _rabbitmqctl("import_definitions", "--format", "json"),
        input=json.dumps({"vhosts": [{"name": vhost}], "permissions": [permissions]}).encode(),
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    finally:
        deletion = subprocess.Popen(
            _rabbitmqctl("delete_vhost", vhost),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _vhosts_deleted.append((vhost, deletion))
