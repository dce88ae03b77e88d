"""A real console (``python -m worker console`` subprocess) and a real browser (Chromium).

The browser is Debian's ``chromium`` driven by Selenium through Debian's
``chromium-driver`` (``tests/services``, README command 2, installs both); Selenium never downloads one.
Screenshots are kept under ``SCREENSHOTS`` (printed by the tests that take them).
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.workers import ROOT, logged_process, worker_env

TOKEN = "console-test-token-0123456789"
SCREENSHOTS = Path(os.environ.get("RATCHET_TEST_SCREENSHOTS", "/tmp/ratchet-console-screenshots"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ConsoleServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def console_env() -> dict[str, str]:
    """More of the console's environment (a test module overrides this fixture)."""
    return {}


@pytest.fixture
def console_server(
    redis_url: str, ledger: Path, tmp_path: Path, console_env: dict[str, str]
) -> Iterator[ConsoleServer]:
    """``python -m worker console`` over the test's Redis stores and broker."""
    port = free_port()
    env = worker_env(
        redis_url, ledger, tmp_path / "data", RATCHET_CONSOLE_TOKEN=TOKEN, **console_env
    )
    log_path = tmp_path / "console.log"
    argv = [sys.executable, "-m", "worker", "console", "--port", str(port)]
    process = logged_process(argv, env, log_path, cwd=ROOT)
    server = ConsoleServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, server.log()
            assert time.monotonic() < deadline, f"console did not answer:\n{server.log()}"
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    assert os.path.exists(CHROMEDRIVER), "chromedriver not found: apt-get install chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1400",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def log_in(browser: WebDriver, url: str, token: str = TOKEN) -> None:
    browser.get(url)
    field = WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "token"))
    field.send_keys(token)
    browser.find_element(By.ID, "login").click()


def screenshot(browser: WebDriver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    # The whole page, not only the window: the timeline is below the fold.
    metrics = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics["cssContentSize"]
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {path}")
    return path
