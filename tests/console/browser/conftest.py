"""The console in a real browser (SPEC v2.2 §10b, adr/0013): headless Chromium from the
system's packages (`/usr/bin/chromium`, installed by `.ci/run`), driven by Playwright's Python
API — never Playwright's own browser download — against a real `runfleet up` fleet started as
tests/cli starts one, with `RUNFLEET_CONSOLE_TOKEN` set.

Without /usr/bin/chromium the tests skip with the reason, unless `CI=true`: there a missing
browser is a failure, so CI can never pass by skipping them. Screenshots of each page go under
the test's tmp dir; with `RUNFLEET_CONSOLE_SHOTS=DIR` they are copied there too (that is how
docs/console/*.png are made).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import Up, eventually, stop_cleanly

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "console-operator-token"
WAIT_MS = 45_000
"""How long a page condition may take (a run through the queue on a loaded 2-core machine)."""
URL = re.compile(r"console on (http://\S+?)/ui/")

if not CHROMIUM.exists():
    if os.environ.get("CI") == "true":
        pytest.fail(f"{CHROMIUM} is missing: .ci/run installs it (apt-get install chromium)")
    pytest.skip(
        f"{CHROMIUM} is missing (apt-get install chromium); the browser tests need it",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

expect.set_options(timeout=WAIT_MS)


@dataclass
class Console:
    """The fleet and its console. A `runfleet` command costs seconds on a loaded machine, so
    the tests launch and check runs through the HTTP API the console serves (`api`), and use
    the CLI where the CLI itself is the point (a launch the page must notice, a refusal the
    form must repeat)."""

    up: Up
    url: str

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}/api/v1{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())

    def launch(self, workflow: str, **variables: str) -> str:
        run = self.api("POST", "/runs", {"workflow": workflow, "vars": variables})
        return str(run["run_id"])

    def run(self, run_id: str) -> dict[str, Any]:
        run = self.api("GET", f"/runs/{run_id}")
        assert isinstance(run, dict)
        return run

    def records(self) -> list[dict[str, Any]]:
        return list(self.api("GET", "/dlq")["records"])

    def publish_raw(self, body: bytes) -> int:
        """`Up.publish_raw` from a thread of its own: it runs an event loop, and Playwright's
        sync API already runs one in this thread."""
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(self.up.publish_raw, body).result(timeout=30)


@pytest.fixture(scope="session")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """One `runfleet up` (its console on a free port) for every browser test."""
    up = Up.start(tmp_path_factory.mktemp("console-fleet"), extra={"RUNFLEET_CONSOLE_TOKEN": TOKEN})
    try:
        found = eventually(
            lambda: URL.search(up.output()), within=30, what="the console URL printed by `up`"
        )
        yield Console(up, found.group(1))
    finally:
        stop_cleanly(up)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Per module, not per session: while Playwright's sync API is open it holds an event loop
    running in this thread, and an async test (pytest-asyncio) after it could not start its
    own."""
    with sync_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium refuses root otherwise
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        try:
            yield chromium
        finally:
            chromium.close()


def _page(browser: Browser, console: Console) -> Iterator[Page]:
    context = browser.new_context(base_url=console.url, viewport={"width": 1280, "height": 900})
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def visitor(browser: Browser, console: Console) -> Iterator[Page]:
    """A browser that has not logged in."""
    yield from _page(browser, console)


@pytest.fixture
def operator(browser: Browser, console: Console) -> Iterator[Page]:
    """A browser logged in with the operator token through the login form."""
    for page in _page(browser, console):
        page.goto("/ui/login")
        page.fill("input[name=token]", TOKEN)
        page.click("#login button[type=submit]")
        expect(page.locator("#who")).to_contain_text("operate")
        yield page


def shot(page: Page, tmp_path: Path, name: str, **kwargs: Any) -> Path:
    """A full-page screenshot under the test's tmp dir (and RUNFLEET_CONSOLE_SHOTS, if set)."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True, **kwargs)
    extra = os.environ.get("RUNFLEET_CONSOLE_SHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)
    return path
