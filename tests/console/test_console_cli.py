"""`runfleet console` (SPEC v2.2 §10, §10c): serves the API from `RUNFLEET_*` settings on
127.0.0.1 unless told otherwise; a tokens file that does not read is a usage error (exit 2)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp

from tests.runner.conftest import Fleet
from tests.support.frozen_heap import CLI_REPORTING_FROZEN, frozen_at_exit

CLI = [sys.executable, "-c", "from runner.cli.main import cli; cli()", "console"]
HELLO = (Path(__file__).resolve().parents[2] / "examples" / "hello.yaml").read_text()


async def read_url(stream: asyncio.StreamReader, within: float = 30.0) -> str:
    deadline = time.monotonic() + within
    seen = b""
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(stream.readline(), deadline - time.monotonic())
        seen += line
        match = re.search(rb"runfleet API on (http://\S+)", line)
        if match:
            return match.group(1).decode()
        if not line:
            break
    raise AssertionError(f"no URL announced: {seen.decode()!r}")


async def test_runfleet_console_serves_the_api_on_localhost_with_the_console_token(
    fleet: Fleet,
) -> None:
    env = {**os.environ, **fleet.env(), "RUNFLEET_CONSOLE_TOKEN": "s3cret"}
    env.pop("RUNFLEET_API_TOKENS", None)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "--port", "0", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        url = await read_url(proc.stderr)
        assert url.startswith("http://127.0.0.1:")
        console = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert console.decode().strip() == f"runfleet console on {url}/ui/"
        auth = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession(url) as http:
            async with http.get("/healthz") as resp:
                assert resp.status == 200
            async with http.get("/ui/runs") as resp:  # the console's pages: read-only, no token
                assert resp.status == 200 and "log in with the operator token" in await resp.text()
            async with http.get("/api/v1/runs") as resp:
                assert resp.status == 401
            async with http.post("/api/v1/runs", json={"workflow": HELLO}, headers=auth) as resp:
                assert resp.status == 201
                run_id = (await resp.json())["run_id"]
        assert (await fleet.store.get_run(run_id)).tenant == "default"
        assert await fleet.stream_messages() == 1
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 15)


async def test_a_tokens_file_that_does_not_read_is_a_usage_error(
    fleet: Fleet, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("only-a-token\n")
    env = {**os.environ, **fleet.env(), "RUNFLEET_API_TOKENS": str(tokens)}
    proc = await asyncio.create_subprocess_exec(
        *CLI, "--port", "0", env=env, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2, err.decode()
    assert "RUNFLEET_API_TOKENS" in err.decode() and "line 1" in err.decode()
    assert "only-a-token" not in err.decode().replace(str(tokens), "")


async def test_runfleet_console_freezes_its_startup_heap_once_it_listens(fleet: Fleet) -> None:
    """ADR-0016: a full collection over the start-up heap would stall every launch in flight;
    the process that serves the API freezes that heap once it listens."""
    env = {**os.environ, **fleet.env(), "RUNFLEET_CONSOLE_TOKEN": "s3cret"}
    env.pop("RUNFLEET_API_TOKENS", None)
    proc = await asyncio.create_subprocess_exec(
        *CLI_REPORTING_FROZEN, "console", "--port", "0", env=env, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    url = await read_url(proc.stderr)
    async with aiohttp.ClientSession(url) as http:  # served as before the freeze
        auth = {"Authorization": "Bearer s3cret"}
        async with http.post("/api/v1/runs", json={"workflow": HELLO}, headers=auth) as resp:
            assert resp.status == 201
    proc.send_signal(signal.SIGTERM)
    _, rest = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, rest.decode()
    assert frozen_at_exit(rest.decode()) > 10_000  # modules, pydantic schemas, aiohttp
