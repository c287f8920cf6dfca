"""The operator CLI's publisher commands (SPEC §10): `streams ensure`, `launch`, `cancel`, run as
a user would run them (a subprocess with `RUNFLEET_*` variables), against the real server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from publisher import WireNames, decode
from store import utcnow
from tests.publisher.conftest import EXAMPLES, Nats, stream_messages
from tests.support.nats_server import NatsServer

RUNFLEET = Path(sys.executable).parent / "runfleet"
DEADLINE_S = 60.0
UNREACHABLE_DEADLINE_S = 20.0
"""A CLI that cannot reach NATS must say so promptly (exit 4), not retry forever."""


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def cli_env(nats_url: str, names: WireNames, data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env.update(
        RUNFLEET_NATS_URL=nats_url,
        RUNFLEET_NAMESPACE=names.namespace,
        RUNFLEET_DATA=str(data),
    )
    return env


async def runfleet(
    *args: str, env: dict[str, str], cwd: Path, deadline: float = DEADLINE_S
) -> Result:
    proc = await asyncio.create_subprocess_exec(
        str(RUNFLEET),
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), deadline)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(
            f"`runfleet {' '.join(args)}` did not exit within {deadline:g}s;"
            f" stderr tail:\n{err.decode(errors='replace')[-2000:]}"
        )
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def test_cli_launch_queues_a_run_on_the_stream(
    nats_server: NatsServer, nats_conn: Nats, names: WireNames, tmp_path: Path
):
    env = cli_env(nats_server.url, names, tmp_path / "data")

    ensured = await runfleet("streams", "ensure", "--json", env=env, cwd=tmp_path)
    assert ensured.code == 0, ensured.stderr
    assert names.runs_stream in ensured.json()["created"]

    before = utcnow()
    launched = await runfleet(
        "launch", str(EXAMPLES / "hello.yaml"), "--var", "name=Ada", "--json", env=env, cwd=tmp_path
    )
    assert launched.code == 0, launched.stderr
    run = launched.json()
    assert run["status"] == "queued"
    assert run["attempt"] == 1
    assert run["workflow"]["name"] == "hello"
    run_id = run["run_id"]

    messages = await stream_messages(nats_conn.js, names)
    assert len(messages) == 1
    msg = messages[0]
    headers = msg.headers or {}
    assert headers["Nats-Msg-Id"] == f"{run_id}:1"
    assert headers["Runfleet-Attempt"] == "1"
    assert headers["Runfleet-Schema"] == "1"
    raw = json.loads(msg.data or b"")
    assert raw["v"] == 1
    assert (raw["run_id"], raw["tenant"], raw["attempt"], raw["kind"]) == (
        run_id,
        "default",
        1,
        "launch",
    )
    assert decode(msg.data or b"", headers).published_at >= before

    # The run document (in RUNFLEET_DATA) recorded the publication's sequence.
    status = await runfleet("status", run_id, "--json", env=env, cwd=tmp_path)
    assert status.code == 0, status.stderr
    assert (status.json()["status"], status.json()["attempt"]) == ("queued", 1)


async def test_cli_streams_ensure_is_idempotent(
    nats_server: NatsServer, nats_conn: Nats, names: WireNames, tmp_path: Path
):
    env = cli_env(nats_server.url, names, tmp_path / "data")
    first = await runfleet("streams", "ensure", "--json", env=env, cwd=tmp_path)
    second = await runfleet("streams", "ensure", "--json", env=env, cwd=tmp_path)
    assert (first.code, second.code) == (0, 0), first.stderr + second.stderr
    assert len(first.json()["created"]) == 5
    assert second.json() == {"created": [], "updated": []}


async def test_cli_launch_with_nats_unreachable_exits_4(names: WireNames, tmp_path: Path):
    env = cli_env("nats://127.0.0.1:1", names, tmp_path / "data")
    result = await runfleet(
        "launch",
        str(EXAMPLES / "hello.yaml"),
        "--json",
        env=env,
        cwd=tmp_path,
        deadline=UNREACHABLE_DEADLINE_S,
    )
    assert result.code == 4, result.stdout + result.stderr
    assert result.json()["error"]["code"] == "nats_unavailable"


async def test_cli_cancel_of_an_unknown_run_is_refused_with_exit_3(
    nats_server: NatsServer, nats_conn: Nats, names: WireNames, tmp_path: Path
):
    env = cli_env(nats_server.url, names, tmp_path / "data")
    result = await runfleet("cancel", "UNKNOWN", "--json", env=env, cwd=tmp_path)
    assert result.code == 3, result.stdout + result.stderr
    error = result.json()["error"]
    assert error["code"] == "run_not_found"
    assert error["remedy"]

    plain = await runfleet("cancel", "UNKNOWN", env=env, cwd=tmp_path)
    assert plain.code == 3
    assert "run_not_found" in plain.stderr
    assert "remedy" in plain.stderr
