"""The operator CLI's publisher commands (SPEC §10): `streams ensure`, `launch`, `cancel`,
`dlq replay`, run as a user would run them (a subprocess with `RUNFLEET_*` variables), against the
real server; and the NATS errors they meet (a deleted stream, a server without JetStream)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from publisher import (
    DlqStore,
    RecordNotFound,
    RunMessage,
    WireNames,
    decode,
    encode,
    ensure_streams,
)
from store import RunStatus, utcnow
from store.sqlite import SqliteRunStore
from tests.publisher.conftest import (
    EXAMPLES,
    Nats,
    put_run,
    stream_messages,
    wire_settings,
)
from tests.support.nats_server import NatsServer, find_nats_server

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
    assert (
        len(first.json()["created"]) == 6
    )  # runs, its consumer, advisories, backstop, DLQ, deliveries
    assert second.json() == {"created": [], "updated": [], "changes": {}}


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


# -- NATS errors the CLI meets (issue 12 item 3): typed, with a remedy, exit 4 -------------------


async def parked_run_with_record(data: Path, dlq: DlqStore, *, record_id: int) -> str:
    """A run parked `DLQ_PARKED` at attempt 2 in the CLI's store (`$RUNFLEET_DATA/runs.db`),
    with the DLQ record its last delivery left."""
    await asyncio.to_thread(data.mkdir, parents=True, exist_ok=True)
    store = await SqliteRunStore.open(data / "runs.db")
    try:
        run = await put_run(
            store,
            status=RunStatus.FAILED_RESUMABLE,
            attempt=2,
            failure_code="DLQ_PARKED",
            cause_code="TOOL_FAILED_TRANSIENT",
        )
    finally:
        await store.close()
    message = RunMessage(
        run_id=run.run_id, tenant="default", attempt=2, kind="launch", published_at=utcnow()
    )
    body, headers = encode(message)
    await dlq.put(
        seq=record_id,
        body=body,
        headers=headers,
        reason="retries_exhausted",
        run_id=run.run_id,
        attempt=2,
        num_delivered=2,
    )
    return run.run_id


async def test_cli_dlq_replay_whose_publish_fails_exits_4_naming_streams_ensure(
    nats_server: NatsServer, nats_conn: Nats, names: WireNames, tmp_path: Path
):
    env = cli_env(nats_server.url, names, tmp_path / "data")
    await ensure_streams(nats_conn.js, names, wire_settings())
    dlq = DlqStore(nats_conn.js, names, None)
    run_id = await parked_run_with_record(tmp_path / "data", dlq, record_id=7)
    await nats_conn.js.delete_stream(names.runs_stream)  # the publish fails after the CAS

    failed = await runfleet("dlq", "replay", "7", "--json", env=env, cwd=tmp_path)
    assert failed.code == 4, failed.stdout + failed.stderr
    (outcome,) = failed.json()["results"]
    assert (outcome["id"], outcome["replayed"]) == (7, False)
    assert outcome["error"]["code"] == "publish_failed"
    assert "runfleet streams ensure" in outcome["error"]["remedy"]
    assert (await dlq.get(7)).run_id == run_id  # kept for the next replay
    status = (await runfleet("status", run_id, "--json", env=env, cwd=tmp_path)).json()
    assert (status["status"], status["attempt"]) == ("failed_resumable", 3)  # flipped back

    ensured = await runfleet("streams", "ensure", env=env, cwd=tmp_path)
    assert ensured.code == 0, ensured.stderr
    replayed = await runfleet("dlq", "replay", "7", "--json", env=env, cwd=tmp_path)
    assert replayed.code == 0, replayed.stdout + replayed.stderr
    assert replayed.json()["results"] == [
        {"id": 7, "run_id": run_id, "attempt": 4, "replayed": True}
    ]
    (message,) = await stream_messages(nats_conn.js, names)
    assert (message.headers or {})["Nats-Msg-Id"] == f"{run_id}:4"
    with pytest.raises(RecordNotFound):
        await dlq.get(7)


async def test_cli_with_the_streams_missing_exits_4_naming_streams_ensure(
    nats_server: NatsServer, nats_conn: Nats, names: WireNames, tmp_path: Path
):
    """No `streams ensure` yet: listing the DLQ is not "no records", showing a record is not
    "no such record", a launch is not an internal error."""
    env = cli_env(nats_server.url, names, tmp_path / "data")
    for args, code in [
        (("dlq", "list"), "stream_not_found"),
        (("dlq", "show", "3"), "stream_not_found"),
        (("launch", str(EXAMPLES / "hello.yaml")), "publish_failed"),
    ]:
        result = await runfleet(*args, "--json", env=env, cwd=tmp_path)
        assert result.code == 4, (args, result.stdout, result.stderr)
        error = result.json()["error"]
        assert error["code"] == code, (args, error)
        assert "runfleet streams ensure" in error["remedy"], (args, error)

    plain = await runfleet("dlq", "list", env=env, cwd=tmp_path)
    assert plain.code == 4
    assert "error [stream_not_found]" in plain.stderr
    assert "remedy: create the streams and consumers with `runfleet streams ensure`" in plain.stderr


@pytest.fixture
def server_without_jetstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A plain `nats-server` (no `-js`): it answers JetStream's API with 503 and takes no
    publish into a stream. Its URL."""
    work = tmp_path_factory.mktemp("nats-no-js")
    proc = subprocess.Popen(
        [str(find_nats_server()), "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ports = work / f"{find_nats_server().name}_{proc.pid}.ports"
        deadline = time.monotonic() + 15
        while not ports.is_file() or not ports.read_text().strip().endswith("}"):
            assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.01)
        yield json.loads(ports.read_text())["nats"][0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_cli_against_a_server_without_jetstream_exits_4_jetstream_unavailable(
    server_without_jetstream: str, names: WireNames, tmp_path: Path
):
    env = cli_env(server_without_jetstream, names, tmp_path / "data")
    ensured = await runfleet("streams", "ensure", "--json", env=env, cwd=tmp_path)
    assert ensured.code == 4, ensured.stdout + ensured.stderr
    error = ensured.json()["error"]
    assert error["code"] == "jetstream_unavailable"
    assert "JetStream" in error["remedy"]

    listed = await runfleet("dlq", "list", env=env, cwd=tmp_path)
    assert listed.code == 4, listed.stdout + listed.stderr
    assert "error [jetstream_unavailable]" in listed.stderr
    assert "internal" not in listed.stderr


async def test_cli_launch_that_no_stream_takes_is_not_called_a_missing_stream(
    server_without_jetstream: str, names: WireNames, tmp_path: Path
):
    """A publish nobody took, where the stream was not reported missing (404), is JetStream
    not answering: a cluster electing (CI: the first launch after `up` restarted a cluster),
    or JetStream off. `streams ensure` would not help; the remedy says to wait and what a
    server needs."""
    env = {**cli_env(server_without_jetstream, names, tmp_path / "data")}
    env["RUNFLEET_PUBLISH_ATTEMPTS"] = "2"
    result = await runfleet("launch", str(EXAMPLES / "hello.yaml"), "--json", env=env, cwd=tmp_path)
    assert result.code == 4, result.stdout + result.stderr
    error = result.json()["error"]
    assert error["code"] == "publish_failed"
    assert "failed after 2 tries" in error["message"]
    assert "no server took the message" in error["message"]
    assert "streams ensure" not in error["remedy"]
    assert "wait a few seconds and retry" in error["remedy"]
