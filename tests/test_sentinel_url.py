"""``redis+sentinel://`` URLs: parsed once, rendered for kombu, refused with the form to use.

The failover itself, on real servers and a real worker: tests/integration/test_sentinel_failover.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import ConfigInvalid, StoreUrlInvalid
from store import open_rejected, open_run_store
from store.rejected.redis import RedisRejected
from store.sentinel import SentinelUrl
from store.snapshots.redis import where
from tasks.broker.transport import SENTINEL_ALIAS, transport_for
from tasks.settings import Settings, load_settings
from worker.app import celery_config

FULL = (
    "redis+sentinel://ana:s%40cret@10.0.0.1:26379,10.0.0.2,[fd00::3]:26380/orders/2"
    "?sentinel_password=guard"
)


def test_a_sentinel_url_names_its_sentinels_service_db_and_both_credentials() -> None:
    parsed = SentinelUrl.parse(FULL)

    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("fd00::3", 26380))
    assert (parsed.service, parsed.db) == ("orders", 2)
    assert (parsed.username, parsed.password) == ("ana", "s@cret")
    assert parsed.sentinel_password == "guard"
    assert parsed.primary_kwargs() == {"db": 2, "username": "ana", "password": "s@cret"}
    assert parsed.sentinel_kwargs(socket_timeout=5) == {"socket_timeout": 5, "password": "guard"}
    assert SentinelUrl.parse(parsed.url()) == parsed


def test_the_db_defaults_to_0_and_the_port_to_sentinels_own() -> None:
    parsed = SentinelUrl.parse("redis+sentinel://sentinel-a/mymaster")

    assert parsed == SentinelUrl((("sentinel-a", 26379),), "mymaster", 0)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+sentinel://h:1,h:2", "name the service"),
        ("redis+sentinel://h:1/svc/0/extra", "name the service"),
        ("redis+sentinel://h:port/svc", "the port is not a number"),
        ("redis+sentinel:///svc", "name at least one sentinel"),
        ("redis+sentinel://h/svc/zero", "database `zero` is not a number"),
        ("redis+sentinel://h/svc?master=x", "unknown parameter(s) master"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_with_the_form(url: str, fragment: str) -> None:
    with pytest.raises(ValueError) as refused:
        SentinelUrl.parse(url)

    assert fragment in str(refused.value)


def test_kombu_gets_its_own_form_and_the_service_as_master_name_and_reads_it_back() -> None:
    parsed = SentinelUrl.parse(FULL)

    url, options = parsed.kombu()

    assert url == (
        "sentinel://ana:s%40cret@10.0.0.1:26379/2;sentinel://10.0.0.2:26379;"
        "sentinel://[fd00::3]:26380"
    )
    assert options == {"master_name": "orders", "sentinel_kwargs": {"password": "guard"}}
    assert SentinelUrl.from_kombu(url, options) == parsed


def test_kombus_form_without_a_master_name_is_refused_saying_what_to_write() -> None:
    with pytest.raises(ValueError) as refused:
        SentinelUrl.from_kombu("sentinel://h:26379", {})

    assert "master_name" in str(refused.value)
    assert "redis+sentinel://" in str(refused.value)


def test_passwords_never_reach_a_message() -> None:
    assert (
        where(FULL)
        == "redis+sentinel://ana:***@10.0.0.1:26379,10.0.0.2:26379,[fd00::3]:26380/orders/2"
    )
    with pytest.raises(StoreUrlInvalid) as refused:
        open_run_store("redis+sentinel://ana:s3cret@h/svc/x?sentinel_password=guard")
    assert "s3cret" not in str(refused.value)
    assert "guard" not in str(refused.value)


def test_a_worker_on_a_sentinel_url_gets_kombus_sentinel_form_and_ratchets_transport() -> None:
    config = celery_config(Settings(broker_url="redis+sentinel://h1:1,h2:2/svc/3"))

    assert config["broker_url"] == "sentinel://h1:1/3;sentinel://h2:2"
    assert config["broker_transport_options"]["master_name"] == "svc"
    # ratchet's visibility timeout and priorities ride along, as on redis://
    assert "visibility_timeout" in config["broker_transport_options"]
    assert transport_for(config["broker_url"]) == SENTINEL_ALIAS


def test_kombus_sentinel_form_in_the_broker_setting_is_refused_naming_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_BROKER_URL", "sentinel://h:26379")
    with pytest.raises(ConfigInvalid) as refused:
        load_settings()

    assert "redis+sentinel://host:port,host:port/service/db" in str(refused.value)


def test_a_sentinel_broker_keeps_refused_messages_on_its_primary(tmp_path: Path) -> None:
    store = open_rejected(
        "sentinel://127.0.0.1:1/4;sentinel://127.0.0.1:2", tmp_path, {"master_name": "svc"}
    )

    # Connects lazily: it names the service's database and nothing more until a message comes
    assert isinstance(store, RedisRejected)
    assert store.where.endswith("(db 4)")
    store.close()
