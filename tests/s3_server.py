"""A real S3-compatible server for the test session: moto's, on a free port of 127.0.0.1.

Fixtures:

- ``s3_server`` (session): the running ``python -m moto.server`` subprocess; a
  test may ``kill()`` it and ``restart()`` it (moto keeps nothing: a restarted
  server is empty).
- ``s3_url`` (function): an ``s3://`` URL naming a bucket of its own, created
  for the test.

The AWS credentials are dummies set for the session; nothing here connects
anywhere but 127.0.0.1.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
START_TIMEOUT_S = 20.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "ratchet-test",
    "AWS_SECRET_ACCESS_KEY": "ratchet-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class S3Server:
    """One moto server process the tests own."""

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.endpoint_url = f"http://{HOST}:{self.port}"
        self.log = directory / "moto.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._admin: Any = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def url(self, bucket: str, prefix: str = "snapshots") -> str:
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint_url}&region=us-east-1"

    def start(self) -> None:
        command = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not self.running:
                raise RuntimeError(f"moto server exited at start:\n{self.log.read_text()}")
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"moto server did not listen within {START_TIMEOUT_S:g} s")
            time.sleep(0.05)

    def kill(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def create_bucket(self, bucket: str) -> None:
        if self._admin is None:
            import boto3

            self._admin = boto3.client(
                "s3", endpoint_url=self.endpoint_url, region_name="us-east-1"
            )
        self._admin.create_bucket(Bucket=bucket)

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
        self.kill()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            patch.delenv(name, raising=False)
        server = S3Server(tmp_path_factory.mktemp("moto"))
        server.start()
        try:
            yield server
        finally:
            server.close()


_buckets = itertools.count(1)


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    if not s3_server.running:
        s3_server.restart()
    bucket = f"ratchet-test-{os.getpid()}-{next(_buckets)}"
    s3_server.create_bucket(bucket)
    return s3_server.url(bucket)
