"""Who may do what over the HTTP API (SPEC v2.2 §10c): no token, no access except `/healthz`;
a read token may not write; a token never sees another tenant's runs, events or DLQ records —
they answer exactly as things that do not exist."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from runner.console import Principal, auth, create_app, load_tokens, sse
from runner.console.api import ROUTES
from runner.console.auth import TokenSource, parse_tokens
from store import RunStatus
from store.settings import SettingsInvalid
from tests.console.conftest import OP_B, READ_A, Api
from tests.publisher.conftest import EXAMPLES, put_run

HELLO = (EXAMPLES / "hello.yaml").read_text()


def concrete(path: str) -> str:
    return path.replace("{run_id}", "01a2321e-0000").replace("{record_id}", "1")


async def test_no_token_no_access_except_healthz(api: Api) -> None:
    for route in ROUTES:
        status, body, resp = await api.call(route.method, concrete(route.path), token=None)
        assert status == 401, route.path
        assert body["error"]["code"] == "unauthorized"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    status, _, _ = await api.call("GET", "/openapi.json", token=None)
    assert status == 401
    status, body, _ = await api.call("GET", "/healthz", token=None)
    assert (status, body) == (200, {"status": "ok"})
    status, body, _ = await api.call("GET", "/api/v1/runs", token="not-a-token")
    assert status == 401 and body["error"]["message"] == "unknown token"


async def test_a_read_token_is_403_on_every_write_and_reads_fine(api: Api) -> None:
    writes = [r for r in ROUTES if r.writes]
    assert {r.operation_id for r in writes} >= {"launch", "resume", "cancel", "rewind"}
    for route in writes:
        status, body, _ = await api.call(
            route.method, concrete(route.path), token=READ_A, json={"workflow": HELLO}
        )
        assert status == 403, route.path
        assert body["error"]["code"] == "forbidden"
    assert await api.fleet.stream_messages() == 0  # the launch queued nothing
    status, _, _ = await api.call("GET", "/api/v1/runs", token=READ_A)
    assert status == 200


async def test_a_token_of_another_tenant_reads_none_of_its_runs_events_or_records(
    api: Api,
) -> None:
    status, run, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO})
    assert status == 201
    run_id = run["run_id"]
    parked = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    record = await api.fleet.dlq.put(
        seq=7, body=b"{}", headers={}, reason="max_deliveries", run_id=run_id, attempt=1
    )

    _, listed, _ = await api.call("GET", "/api/v1/runs", token=OP_B)
    assert listed["runs"] == []
    for path in (
        f"/api/v1/runs/{run_id}",
        f"/api/v1/runs/{run_id[:12]}",
        f"/api/v1/runs/{run_id}/events",
        f"/api/v1/runs/{run_id}/events/stream",
        f"/api/v1/runs/{run_id}/timeline",
    ):
        status, body, _ = await api.call("GET", path, token=OP_B)
        assert status == 404 and body["error"]["code"] == "run_not_found", path
    for action, payload in (("resume", {}), ("cancel", None), ("rewind", {"node": "greet"})):
        status, body, _ = await api.call(
            "POST", f"/api/v1/runs/{parked.run_id}/{action}", token=OP_B, json=payload
        )
        assert status == 404 and body["error"]["code"] == "run_not_found", action

    _, records, _ = await api.call("GET", "/api/v1/dlq", token=OP_B)
    assert records["records"] == []
    status, body, _ = await api.call("GET", f"/api/v1/dlq/{record.id}", token=OP_B)
    assert status == 404 and body["error"]["code"] == "record_not_found"
    for action in ("replay", "purge"):
        status, body, _ = await api.call(
            "POST", f"/api/v1/dlq/{action}", token=OP_B, json={"ids": [record.id]}
        )
        assert status == 404 and body["error"]["code"] == "record_not_found", action
        _, purged, _ = await api.call(
            "POST", f"/api/v1/dlq/{action}", token=OP_B, json={"all": True}
        )
        assert purged.get("purged", []) == [] and purged.get("outcomes", []) == []

    # ... while its own tenant sees all of it, untouched
    _, mine, _ = await api.call("GET", "/api/v1/dlq")
    assert [r["id"] for r in mine["records"]] == [record.id]
    status, shown, _ = await api.call("GET", f"/api/v1/dlq/{record.id}")
    assert status == 200 and shown["run"]["run_id"] == run_id
    assert (await api.env.store.get_run(parked.run_id)).status is RunStatus.PAUSED_OPERATOR


def test_tokens_file_binds_each_token_to_a_tenant_and_role(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\nabc tenant-a read\n\ndef tenant-b operate  # trailing\n")

    book = load_tokens("default", {"RUNFLEET_API_TOKENS": str(path), "RUNFLEET_CONSOLE_TOKEN": "c"})

    assert book.lookup("abc") == Principal("tenant-a", "read")
    assert book.lookup("def") == Principal("tenant-b", "operate")
    assert book.lookup("c") == Principal("default", "operate")
    assert book.lookup("nope") is None
    assert "abc" not in repr(book)  # kept by digest only
    assert len(load_tokens("default", {})) == 0


@pytest.mark.parametrize("line", ["abc tenant-a admin", "abc", "abc t read extra"])
def test_a_tokens_line_that_does_not_read_is_a_usage_error_naming_the_line(line: str) -> None:
    with pytest.raises(SettingsInvalid) as info:
        parse_tokens(f"ok t read\n{line}\n", "/etc/tokens")
    assert "RUNFLEET_API_TOKENS" in str(info.value.problems[0].message)
    assert "line 2" in info.value.problems[0].message
    assert "abc" not in info.value.problems[0].message.replace("/etc/tokens", "")


async def test_a_token_file_change_takes_effect_without_a_restart(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an API walkthrough: a token removed from the file (a revoked one) worked until
    the server restarted. The file is swapped as a Secret's update swaps it; one that does not
    read keeps the tokens read before. (Every request looks here; the server looks once a
    second at most.)"""
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    path.write_text("old-token default operate\n")
    source = TokenSource.from_env("default", {"RUNFLEET_API_TOKENS": str(path)})

    def swap(text: str) -> None:
        fresh = tmp_path / "tokens.new"
        fresh.write_text(text)
        os.replace(fresh, path)

    async with TestClient(TestServer(create_app(api.env, source))) as client:

        async def status_with(token: str) -> int:
            resp = await client.get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
            return resp.status

        assert await status_with("old-token") == 200
        swap("new-token default read\n")
        assert await status_with("new-token") == 200
        assert await status_with("old-token") == 401

        swap("new-token default admin\nold-token default operate\n")  # does not read
        assert await status_with("new-token") == 200
        assert await status_with("old-token") == 401


async def test_a_revoked_token_ends_the_event_streams_it_opened(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a security walkthrough: an events stream opened before its token was revoked
    went on sending the run's events (and outputs) to the end. The stream looks as it goes and
    ends with an `error` event saying so; nothing after the revocation is sent."""
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    monkeypatch.setattr(sse, "RECHECK_S", 0.05)
    path = tmp_path / "tokens"
    path.write_text("kept default operate\nrevoked default read\n")
    source = TokenSource.from_env("default", {"RUNFLEET_API_TOKENS": str(path)})
    run = await put_run(api.env.store, status=RunStatus.QUEUED)  # no runner: it stays quiet

    async with TestClient(TestServer(create_app(api.env, source))) as client:
        resp = await client.get(
            f"/api/v1/runs/{run.run_id}/events/stream",
            headers={"Authorization": "Bearer revoked"},
        )
        assert resp.status == 200
        fresh = tmp_path / "tokens.new"
        fresh.write_text("kept default operate\n")
        os.replace(fresh, path)
        await api.env.store.append_event(run.run_id, "after_revocation", {}, attempt=1)

        text = await asyncio.wait_for(resp.text(), 10)  # the stream ends by itself

    assert "event: error" in text and "no longer holds" in text, text
    assert "after_revocation" not in text
    assert "event: end" not in text
