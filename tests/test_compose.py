"""docker-compose.yml is valid Compose and wires the fleet as the README says.

No Docker engine runs here, so the file is checked against the Compose
Specification's JSON schema (vendored in tests/schemas/, so the test never
depends on what lies beside the clone) and read for the wiring.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATHS = (
    ROOT / "tests" / "schemas" / "compose-spec.json",
    ROOT.parent / "shared" / "schemas" / "compose-spec.json",
)


def compose_schema() -> dict[str, Any]:
    for path in SCHEMA_PATHS:
        if path.is_file():
            schema: dict[str, Any] = json.loads(path.read_text())
            return schema
    raise AssertionError(f"no Compose schema at any of {[str(p) for p in SCHEMA_PATHS]}")


def compose_file() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return document


def errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(compose_schema())
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def test_the_compose_file_is_valid_against_the_compose_specification() -> None:
    assert errors(compose_file()) == []


def test_the_schema_check_rejects_a_service_with_an_unknown_key() -> None:
    # The check above can fail: a typo in a service's keys is caught.
    broken = copy.deepcopy(compose_file())
    broken["services"]["worker"]["replica"] = 2

    assert any("replica" in e for e in errors(broken))


def test_the_fleet_has_every_service_the_readme_names() -> None:
    services = compose_file()["services"]

    assert {"redis", "minio", "minio-setup", "worker", "beat", "flower", "demo"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["worker"]["command"][:4] == ["celery", "-A", "worker", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "worker", "beat"]
    assert "--appendonly" in services["redis"]["command"]
    assert (
        services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1]
        == "yes"
    )


def test_every_ratchet_service_uses_redis_and_s3_through_the_settings() -> None:
    services = compose_file()["services"]

    for name in ("worker", "beat", "flower", "demo"):
        env = services[name]["environment"]
        assert env["RATCHET_BROKER_URL"].startswith("redis://redis:6379/"), name
        assert env["RATCHET_RUN_STORE"].startswith("redis://redis:6379/"), name
        assert env["RATCHET_SNAPSHOT_STORE"].startswith("s3://"), name
        assert "endpoint_url=http://minio:9000" in env["RATCHET_SNAPSHOT_STORE"], name
        assert services[name]["build"] == "."


def test_the_demo_runs_the_example_agent_once_and_waits() -> None:
    demo = compose_file()["services"]["demo"]

    assert demo["command"][:4] == ["ratchet", "runs", "start", "examples/refund-desk.toml"]
    assert "--wait" in demo["command"] and "--input" in demo["command"]
    assert demo["restart"] == "no"
    assert (ROOT / demo["command"][3]).is_file()


def test_the_image_installs_the_s3_extra() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()

    assert 'pip install ".[s3]"' in dockerfile
    assert "FROM python:3.11" in dockerfile
