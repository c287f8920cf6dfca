"""The console's pages (SPEC v2.2 §10b) over HTTP, without a browser: the safety rules —
escaped output, read-only without the operator token, CSRF on every form, tenant scope — on the
same app and real fleet as the API tests. The browser tests (tests/console/browser) drive the
same pages in Chromium."""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import hmac
import json
import os
import re
import time
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import nats.errors
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.js import JetStreamContext

from publisher import DlqStore
from publisher.errors import NatsUnavailable
from runner import operations as ops
from runner.console import Principal, TokenBook, auth, create_app, ui_runs
from runner.console.auth import TokenSource
from runner.console.pages import loopback_host
from runner.delivery_log import read_deliveries
from store import Checkpoint, Lease, RunStatus, StagedFile, Update, utcnow
from tests.console.conftest import OP_A, OP_B, READ_A, TOKENS, Api
from tests.console.test_api_errors import raw_http
from tests.console.test_api_uploads import paused_on_a_file_question, upload
from tests.publisher.conftest import put_run

SCRIPT = "<script>alert('owned')</script><b>bold</b>"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def get_html(client: TestClient[Any, Any], path: str) -> tuple[int, str]:
    resp = await client.get(path)
    return resp.status, await resp.text()


async def csrf_of(client: TestClient[Any, Any], path: str = "/ui/runs") -> str:
    _, html = await get_html(client, path)
    match = CSRF.search(html)
    assert match, html[:500]
    return match.group(1)


async def log_in(client: TestClient[Any, Any], token: str) -> None:
    csrf = await csrf_of(client, "/ui/login")
    resp = await client.post(
        "/ui/login", data={"token": token, "csrf": csrf}, allow_redirects=False
    )
    assert resp.status == 303, await resp.text()


async def test_console_output_escaped_a_node_output_with_html_is_shown_as_text(api: Api) -> None:
    run = await put_run(
        api.env.store,
        status=RunStatus.FINISHED,
        checkpoint=Checkpoint(progress=1, outputs={"greet": SCRIPT}),
    )
    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert status == 200
    assert SCRIPT not in html
    assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt;" in html
    resp = await api.client.get(f"/ui/runs/{run.run_id}")
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]


async def test_console_without_a_login_is_read_only_and_says_so(api: Api) -> None:
    run = await put_run(api.env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert status == 200 and 'id="read-only"' in html and "log in with the operator token" in html
    assert "Fix the cause named by the cause code" in html  # what to do about DLQ_PARKED

    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(f"/ui/runs/{run.run_id}/cancel", data={"csrf": csrf})
    assert resp.status == 403 and "forbidden" in await resp.text()
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.FAILED_RESUMABLE


async def test_console_a_read_token_may_not_write_and_an_operate_token_may(api: Api) -> None:
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, READ_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(f"/ui/runs/{run.run_id}/cancel", data={"csrf": csrf})
    assert resp.status == 403 and "read role" in await resp.text()

    api.client.session.cookie_jar.clear()
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(
        f"/ui/runs/{run.run_id}/cancel", data={"csrf": csrf}, allow_redirects=False
    )
    assert resp.status == 303
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.CANCELLED


async def test_console_csrf_every_form_post_without_the_sessions_token_is_refused(api: Api) -> None:
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, OP_A)
    for data in ({}, {"csrf": "forged"}):
        resp = await api.client.post(f"/ui/runs/{run.run_id}/cancel", data=data)
        assert resp.status == 403 and "csrf" in await resp.text()
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.PAUSED_OPERATOR


async def test_console_login_rotates_the_session_and_the_cookie_is_httponly(api: Api) -> None:
    resp = await api.client.get("/ui/login")
    before = resp.cookies["runfleet_session"]
    assert before["httponly"] and before["samesite"] == "Strict"
    csrf = CSRF.search(await resp.text())
    assert csrf
    resp = await api.client.post(
        "/ui/login", data={"token": OP_A, "csrf": csrf.group(1)}, allow_redirects=False
    )
    after = resp.cookies["runfleet_session"]
    assert after.value != before.value and OP_A not in after.value
    resp = await api.client.post(
        "/ui/login", data={"token": "wrong", "csrf": csrf.group(1)}, allow_redirects=False
    )
    assert resp.status == 403  # the old session (and its CSRF token) is gone


async def test_console_tenant_scoped_another_tenants_run_is_not_found(api: Api) -> None:
    theirs = await put_run(api.env.store, status=RunStatus.FINISHED, tenant="b")
    status, html = await get_html(api.client, f"/ui/runs/{theirs.run_id}")
    assert status == 404 and "run_not_found" in html
    await log_in(api.client, OP_B)
    status, _ = await get_html(api.client, f"/ui/runs/{theirs.run_id}")
    assert status == 200


async def test_console_bound_beyond_loopback_asks_for_a_token_before_showing_anything(
    api: Api,
) -> None:
    app = create_app(api.env, TOKENS, open_reads=False)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/ui/runs", allow_redirects=False)
        assert resp.status == 303 and resp.headers["Location"] == "/ui/login"
        await log_in(client, READ_A)
        status, html = await get_html(client, "/ui/runs")
        assert status == 200 and "Runs" in html


async def test_console_without_any_token_is_read_only_and_says_it_was_started_without_one(
    api: Api,
) -> None:
    async with TestClient(TestServer(create_app(api.env, TokenBook.of({})))) as client:
        status, html = await get_html(client, "/ui/runs")
        assert status == 200 and "started without RUNFLEET_CONSOLE_TOKEN" in html


async def test_console_the_api_still_needs_its_bearer_token(api: Api) -> None:
    status, _, _ = await api.call("GET", "/api/v1/runs", token=None)
    assert status == 401
    resp = await api.client.get("/", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/ui/runs"
    resp = await api.client.get("/ui/static/htmx.min.js")
    assert resp.status == 200 and "htmx" in (await resp.text())[:2000]


async def test_console_a_session_from_one_replica_is_honoured_by_another_with_the_same_tokens(
    api: Api,
) -> None:
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, OP_A)
    cookie = api.client.session.cookie_jar.filter_cookies(api.client.make_url("/"))
    session = cookie["runfleet_session"].value
    async with TestClient(TestServer(create_app(api.env, TOKENS))) as other:
        other.session.cookie_jar.update_cookies({"runfleet_session": session})
        csrf = await csrf_of(other, f"/ui/runs/{run.run_id}")
        resp = await other.post(
            f"/ui/runs/{run.run_id}/cancel", data={"csrf": csrf}, allow_redirects=False
        )
        assert resp.status == 303
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.CANCELLED


async def test_console_a_forged_cookie_or_a_removed_token_is_not_a_login(api: Api) -> None:
    await log_in(api.client, OP_A)
    cookie = api.client.session.cookie_jar.filter_cookies(api.client.make_url("/"))
    session = cookie["runfleet_session"].value
    payload, _, signature = session.rpartition(".")
    forged = f"{payload}.{'0' * len(signature)}"
    fewer = TokenBook.of({READ_A: Principal("default", "read")})
    for value, tokens in ((forged, TOKENS), (session, fewer)):
        async with TestClient(TestServer(create_app(api.env, tokens))) as other:
            other.session.cookie_jar.update_cookies({"runfleet_session": value})
            status, html = await get_html(other, "/ui/runs")
            assert status == 200 and "not logged in" in html and "operate" not in html


async def test_console_a_session_cookie_gives_no_way_to_sign_another(api: Api) -> None:
    """The signing key was the SHA-256 of a tag and the tokens' digests, and a cookie held its
    token's plain digest: from one cookie of a one-token console anyone could sign sessions
    with any expiry and CSRF value (found by a security walkthrough). Now the cookie shows no
    plain hash of the token, a session signed as before is refused, and so is one of ours
    that claims an expiry past the session's lifetime."""
    only = TokenBook.of({OP_A: Principal("default", "operate")})
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    async with TestClient(TestServer(create_app(api.env, only))) as client:
        await log_in(client, OP_A)
        cookie = client.session.cookie_jar.filter_cookies(client.make_url("/"))
        payload, _, _ = cookie["runfleet_session"].value.rpartition(".")
        body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        plain = hashlib.sha256(OP_A.encode()).hexdigest()
        assert body["d"] != plain  # no plain hash of the token to guess at offline

        def signed(session: dict[str, object], key: bytes) -> str:
            raw = json.dumps(session, separators=(",", ":")).encode()
            data = base64.urlsafe_b64encode(raw).decode().rstrip("=")
            return f"{data}.{hmac.new(key, data.encode(), hashlib.sha256).hexdigest()}"

        old_key = hashlib.sha256(b"runfleet console session\n" + plain.encode()).digest()
        forged = {"c": "mine", "d": plain, "e": time.time() + 10 * 365 * 86400, "f": None}
        too_long = {**body, "e": time.time() + 10 * 365 * 86400}
        for value in (signed(forged, old_key), signed(too_long, only.secret)):
            async with TestClient(TestServer(create_app(api.env, only))) as other:
                other.session.cookie_jar.update_cookies({"runfleet_session": value})
                resp = await other.post(
                    f"/ui/runs/{run.run_id}/cancel", data={"csrf": "mine"}, allow_redirects=False
                )
                assert resp.status == 403
                _, html = await get_html(other, "/ui/runs")
                assert "not logged in" in html
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.PAUSED_OPERATOR


async def test_console_the_session_cookie_is_secure_behind_a_proxy_that_terminated_tls(
    api: Api,
) -> None:
    resp = await api.client.get("/ui/login", headers={"X-Forwarded-Proto": "https"})
    assert resp.cookies["runfleet_session"]["secure"]
    resp = await api.client.get("/ui/login")
    assert not resp.cookies["runfleet_session"]["secure"]


async def test_console_logout_ends_the_login(api: Api) -> None:
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client)
    resp = await api.client.post("/ui/logout", data={"csrf": csrf})
    assert resp.status == 200 and "not logged in" in await resp.text()


async def test_console_dlq_pages_show_and_replay_only_the_viewers_tenants_records(
    api: Api,
) -> None:
    mine = await put_run(
        api.env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED"
    )
    theirs = await put_run(api.env.store, status=RunStatus.FAILED_RESUMABLE, tenant="b")
    dlq = DlqStore(api.fleet.js, api.fleet.names, api.fleet.blobs)
    body = b'{"v": 1}'
    for seq, run in ((41, mine), (42, theirs)):
        await dlq.put(seq=seq, body=body, headers={}, reason="max_deliveries", run_id=run.run_id)
    await log_in(api.client, OP_A)
    status, html = await get_html(api.client, "/ui/dlq?reason=max_deliveries")
    assert status == 200 and 'data-record="41"' in html and 'data-record="42"' not in html
    status, _ = await get_html(api.client, "/ui/dlq/42")
    assert status == 404

    csrf = await csrf_of(api.client, "/ui/dlq?reason=max_deliveries")
    resp = await api.client.post(
        "/ui/dlq/purge", data={"csrf": csrf, "all": "yes", "reason": "max_deliveries"}
    )
    text = await resp.text()
    assert resp.status == 200 and 'data-record="41"' in text and 'data-record="42"' not in text
    assert {r.id for r in await dlq.list()} == {41, 42}  # the confirmation purged nothing

    resp = await api.client.post("/ui/dlq/purge", data={"csrf": csrf, "confirm": "yes", "id": "42"})
    assert resp.status == 404 and "record_not_found" in await resp.text()
    resp = await api.client.post("/ui/dlq/purge", data={"csrf": csrf, "confirm": "yes", "id": "41"})
    assert "purged 1 record(s): 41" in await resp.text()
    assert {r.id for r in await dlq.list()} == {42}


async def read_event(resp: Any, name: str, needle: str, within: float = 20.0) -> str:
    """The first SSE event `name` whose data contains `needle`."""
    async with asyncio.timeout(within):
        event, data = "", []
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line:
                text = "\n".join(data)
                if event == name and needle in text:
                    return text
                event, data = "", []
    raise AssertionError(f"the stream ended without {name!r} containing {needle!r}")


async def test_console_a_full_runs_page_says_more_runs_exist_and_how_to_page_on(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list stopped at 100 rows without a word while the counts said more were there."""
    monkeypatch.setattr(ui_runs, "RUNS_SHOWN", 2)
    runs = [await put_run(api.env.store, status=RunStatus.FINISHED) for _ in range(3)]
    status, html = await get_html(api.client, "/ui/runs")
    assert status == 200
    assert "the newest 2 shown" in html
    assert f"runfleet runs --after {runs[1].run_id}" in html  # newest first: 2 then 1


async def test_console_live_runs_stream_sends_a_run_created_after_it_opened(api: Api) -> None:
    async with api.client.get("/ui/runs/live") as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        await read_event(resp, "counts", "")
        run = await put_run(api.env.store, status=RunStatus.FINISHED)
        rows = await read_event(resp, "runs", run.run_id)
        assert f'data-run="{run.run_id}"' in rows


async def test_console_a_revoked_tokens_live_page_stops_showing_the_tenants_runs(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a security walkthrough: a live runs page opened by a token since revoked went
    on pushing the tenant's new runs. It looks at its session as it goes: once the token no
    longer holds, it says so and ends; a run made after that is never sent."""
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    path.write_text("revoked-op default operate\n")
    source = TokenSource.from_env("default", {"RUNFLEET_API_TOKENS": str(path)})
    async with TestClient(TestServer(create_app(api.env, source))) as client:
        await log_in(client, "revoked-op")
        async with client.get("/ui/runs/live") as resp:
            await read_event(resp, "counts", "")
            fresh = tmp_path / "tokens.new"
            fresh.write_text("someone-else default operate\n")
            os.replace(fresh, path)
            ended = await read_event(resp, "problem", "no longer holds")
            assert "log in again" in ended
            later = await put_run(api.env.store, status=RunStatus.FINISHED)
            rest = await asyncio.wait_for(resp.content.read(), 10)  # the stream has ended
            assert later.run_id.encode() not in rest


async def test_console_dlq_bulk_replay_by_reason_replays_every_record_with_it(api: Api) -> None:
    dlq = DlqStore(api.fleet.js, api.fleet.names, api.fleet.blobs)
    runs = []
    for seq in (51, 52):
        run = await put_run(
            api.env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED"
        )
        runs.append(run)
        await dlq.put(
            seq=seq,
            body=b"{}",
            headers={},
            reason="retries_exhausted",
            run_id=run.run_id,
            attempt=1,
        )
    await dlq.put(seq=53, body=b"{}", headers={}, reason="internal_error", run_id=runs[0].run_id)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, "/ui/dlq?reason=retries_exhausted")
    resp = await api.client.post(
        "/ui/dlq/replay",
        data={"csrf": csrf, "all": "yes", "reason": "retries_exhausted"},
        allow_redirects=False,
    )
    assert resp.status == 303, await resp.text()
    _, flash = await get_html(api.client, resp.headers["Location"])
    for seq, run in zip((51, 52), runs, strict=True):
        assert f"record {seq} → run {run.run_id[:13]} queued" in flash
        assert (await api.env.store.get_run(run.run_id)).status is RunStatus.QUEUED
    assert {r.id for r in await dlq.list()} == {53}


async def test_console_dlq_filter_by_an_unknown_reason_is_a_400_naming_the_reasons(
    api: Api,
) -> None:
    """It showed an empty list offering to "replay every record with reason bogus"."""
    await log_in(api.client, OP_A)
    status, html = await get_html(api.client, "/ui/dlq?reason=bogus")
    assert status == 400 and "invalid_request" in html and "retries_exhausted" in html


async def test_console_a_record_whose_replay_would_be_refused_says_why_and_offers_no_replay(
    api: Api,
) -> None:
    """It said "replayable no" beside an active replay button whose click was refused."""
    dlq = DlqStore(api.fleet.js, api.fleet.names, api.fleet.blobs)
    await dlq.put(seq=61, body=b"\xff", headers={}, reason="malformed", replayable=False)
    await log_in(api.client, OP_A)
    status, html = await get_html(api.client, "/ui/dlq/61")
    assert status == 200
    assert "no: record_not_replayable" in html
    assert re.search(r'<button type="submit" disabled[^>]*>replay</button>', html), html[-1500:]


async def test_console_offers_a_rewind_to_the_failed_node_not_only_to_completed_ones(
    api: Api,
) -> None:
    """ "fix, rewind to the node, resume" (TOOL_FAILED_PERMANENT's advice) needs the failed
    node: the page offered only completed ones, while `runfleet rewind --node` took it."""
    run = await put_run(
        api.env.store,
        status=RunStatus.FAILED,
        failure_code="TOOL_FAILED_PERMANENT",
        checkpoint=Checkpoint(completed=["a"], restart_node="b", progress=1),
    )
    await log_in(api.client, OP_A)
    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert status == 200
    assert "<option>a</option><option>b</option>" in html, html[-3000:]
    assert '<dd id="at-node">b <small>' in html  # where a resume starts, as `status` says


async def test_console_cancel_of_a_running_run_says_it_is_only_requested(api: Api) -> None:
    """ "cancel: the run is running" read as a cancel that did nothing."""
    held = Lease(owner="r:1", token="t", attempt=1, expires_at=utcnow() + timedelta(minutes=5))
    run = await put_run(api.env.store, status=RunStatus.RUNNING, lease=held)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(f"/ui/runs/{run.run_id}/cancel", data={"csrf": csrf})
    html = await resp.text()
    assert resp.status == 200 and "cancel requested: the runner checkpoints and stops" in html
    assert (await api.env.store.get_run(run.run_id)).cancel_requested


async def test_console_a_refused_action_on_a_run_shows_the_refusal_on_the_runs_page(
    api: Api,
) -> None:
    """The refusal replaced the page, offering only "runs · DLQ", at the action's POST address
    (walkthroughs, twice): now the run's own page, as it is now, says what was refused, once."""
    run = await put_run(api.env.store, status=RunStatus.FINISHED)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(
        f"/ui/runs/{run.run_id}/resume", data={"csrf": csrf}, allow_redirects=False
    )
    assert resp.status == 303 and resp.headers["Location"] == f"/ui/runs/{run.run_id}"

    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert status == 200 and 'id="refused"' in html
    assert "refused (run_not_resumable):" in html
    assert 'id="cancel-form"' in html or 'id="summary"' in html  # the run's page itself
    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert 'id="refused"' not in html  # said once


async def test_console_ui_without_its_slash_and_the_favicon_are_not_the_apis_401(
    api: Api,
) -> None:
    resp = await api.client.get("/ui", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/ui/runs"
    resp = await api.client.get("/favicon.ico")
    assert resp.status == 204


def test_console_templates_and_assets_ship_in_the_package() -> None:
    """Every template and vendored asset matches the package-data globs: an installed console
    has its pages (SPEC v2.2 §10b: the assets ship inside the package)."""
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["runner.console"]
    here = root / "runner" / "console"
    files = [
        p.relative_to(here).as_posix()
        for d in ("templates", "static")
        for p in (here / d).iterdir()
    ]
    assert "static/htmx.min.js" in files and "templates/base.html" in files
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not unshipped


async def test_console_run_page_caps_node_outputs_and_shows_attachments(api: Api) -> None:
    big = "x" * 10_000
    attachment = StagedFile(
        name="report", filename="report.csv", bytes=12, sha256="ab" * 32, key="runs/x/report"
    )
    run = await put_run(
        api.env.store,
        status=RunStatus.FINISHED,
        checkpoint=Checkpoint(progress=1, outputs={"big": big}),
        attachments=[attachment],
    )
    status, html = await get_html(api.client, f"/ui/runs/{run.run_id}")
    assert status == 200 and big not in html and "x" * 4000 in html
    assert "6000 more characters" in html
    assert "report = report.csv (12 bytes" in html


async def test_console_a_filter_that_does_not_read_is_refused_with_the_accepted_form(
    api: Api,
) -> None:
    status, html = await get_html(api.client, "/ui/runs?since=yesterday&workflow=nightly")
    assert status == 400 and "since: &#39;yesterday&#39; is not accepted" in html
    # the runs page itself, the filters as typed (they were lost on an error page) and no
    # live stream that would be refused the same way
    assert 'id="filter-problem"' in html and 'id="filters"' in html
    assert 'name="workflow" value="nightly"' in html and 'name="since" value="yesterday"' in html
    assert "sse-connect" not in html
    status, html = await get_html(api.client, "/ui/dlq?older_than=soon")
    assert status == 400 and "older_than" in html


async def test_console_an_unexpected_error_is_an_html_error_page_not_json(
    api: Api, monkeypatch: Any
) -> None:
    """A bug in a page's handler reaches the operator as the console's own error page (500,
    HTML, no internals), not the API's JSON body."""
    run = await put_run(api.env.store, status=RunStatus.FINISHED)

    async def broken(run_id: str) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(api.env.store, "get_run", broken)
    resp = await api.client.get(f"/ui/runs/{run.run_id}")
    html = await resp.text()
    assert resp.status == 500
    assert resp.headers["Content-Type"].startswith("text/html"), html[:300]
    assert "internal error (logged)" in html
    assert "secret internals" not in html


async def test_console_a_file_question_is_answered_by_an_upload_id_never_a_server_path(
    api: Api,
) -> None:
    """Found by review: the answer form passed `answer.doc=@/path` on as a CLI answer, and the
    operations staged that path from the server's own disk into the caller's run. The form
    takes a file question's answer as an upload id, as the API does."""
    run_id = await paused_on_a_file_question(api)
    secret = api.fleet.tmp / "server-secret.txt"
    secret.write_text("not for callers")
    await log_in(api.client, OP_A)
    for value in (f"@{secret}", str(secret)):
        csrf = await csrf_of(api.client, f"/ui/runs/{run_id}")
        resp = await api.client.post(
            f"/ui/runs/{run_id}/answer",
            data={"csrf": csrf, "answer.doc": value},
            allow_redirects=False,
        )
        assert resp.status in (404, 422), (value, resp.status)
        assert (await api.env.store.get_run(run_id)).status == "paused_waiting_human"
    assert not list((api.fleet.tmp / "blobs").rglob("server-secret.txt"))

    staged = await upload(api, b"answered by upload\n", filename="doc.txt")
    csrf = await csrf_of(api.client, f"/ui/runs/{run_id}")
    resp = await api.client.post(
        f"/ui/runs/{run_id}/answer",
        data={"csrf": csrf, "answer.doc": staged["upload_id"]},
        allow_redirects=False,
    )
    assert resp.status == 303, await resp.text()
    done = await api.fleet.wait_status(run_id, "finished")
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["show_doc"] == "answered by upload"


async def test_console_an_unknown_upload_id_is_refused_beside_its_field_keeping_the_form(
    api: Api,
) -> None:
    """It replaced the page with a 404 and lost every answer typed (docs/console.md: shown
    beside its field, and the form keeps what was typed)."""
    run_id = await paused_on_a_file_question(api)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run_id}")
    resp = await api.client.post(
        f"/ui/runs/{run_id}/answer",
        data={"csrf": csrf, "answer.doc": "no-such-upload"},
        allow_redirects=False,
    )
    html = await resp.text()
    assert resp.status == 422, html[:500]
    assert "upload_not_found" in html and "runfleet upload FILE" in html
    assert 'value="no-such-upload"' in html  # what was typed is still in the form
    assert (await api.env.store.get_run(run_id)).status == "paused_waiting_human"


async def test_console_answers_to_a_run_cancelled_since_the_form_was_drawn_change_nothing(
    api: Api,
) -> None:
    """Found by an operator walkthrough: a form drawn while the run waited, submitted after
    another tab cancelled it, became a plain resume (no question left to read the answer
    names from): the cancel was undone and the answers dropped."""
    run_id = await paused_on_a_file_question(api)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run_id}")  # the form, drawn while it waits
    await api.call("POST", f"/api/v1/runs/{run_id}/cancel", template="/api/v1/runs/{run_id}/cancel")
    assert (await api.env.store.get_run(run_id)).status == "cancelled"

    resp = await api.client.post(
        f"/ui/runs/{run_id}/answer",
        data={"csrf": csrf, "answer.doc": "anything"},
        allow_redirects=True,
    )

    html = await resp.text()
    assert resp.status == 200 and "not answered: answers_invalid" in html
    doc = await api.env.store.get_run(run_id)
    assert doc.status == "cancelled"  # the cancel stands
    events = [e.type for e in await api.env.store.read_events(run_id)]
    assert "run_resumed" not in events


async def test_console_a_duration_too_large_to_represent_is_a_400_page(api: Api) -> None:
    """`1e300` seconds would overflow `now - since` or a raised cap: the filter's or the
    form's 400, never a 500 page."""
    for path in ("/ui/runs?since=1e300", "/ui/runs?since=999999d"):
        status, html = await get_html(api.client, path)
        assert status == 400 and 'id="filter-problem"' in html, (path, html[:300])
    status, html = await get_html(api.client, "/ui/dlq?older_than=1e300")
    assert status == 400 and "invalid_request" in html, html[:300]
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, OP_A)
    csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
    resp = await api.client.post(
        f"/ui/runs/{run.run_id}/resume", data={"csrf": csrf, "max_duration": "1e300"}
    )
    assert resp.status == 400 and "longer than 100 years" in await resp.text()
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.PAUSED_OPERATOR


async def test_console_a_raised_cap_that_does_not_read_names_the_field_never_a_parser(
    api: Api,
) -> None:
    """Found by an operator walkthrough: "invalid literal for int() with base 10", "1
    validation error for BudgetRequest", "could not convert string to float"."""
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, OP_A)
    for field, raw, label in (
        ("max_iterations", "abc", "max iterations"),
        ("max_iterations", "0", "max iterations"),
        ("max_iterations", "1.5", "max iterations"),
        ("max_cost_usd", "lots", "max cost (USD)"),
        ("max_cost_usd", "-1", "max cost (USD)"),
        ("max_duration", "-5s", "max duration"),
    ):
        csrf = await csrf_of(api.client, f"/ui/runs/{run.run_id}")
        resp = await api.client.post(
            f"/ui/runs/{run.run_id}/resume", data={"csrf": csrf, field: raw}
        )
        html = await resp.text()
        assert resp.status == 400, (field, raw)
        assert f"{label}: &#39;{raw}&#39; is not accepted" in html, (field, raw, html[:2000])
        for internal in ("literal for int", "validation error", "could not convert"):
            assert internal not in html, (field, raw)
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.PAUSED_OPERATOR


async def test_console_a_csrf_token_that_is_not_ascii_is_a_plain_403(api: Api) -> None:
    """`hmac.compare_digest` refuses a str that is not ASCII: the check compares bytes, so a
    form's `csrf=é` is the stale-token 403 like any other wrong token."""
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await log_in(api.client, OP_A)
    resp = await api.client.post(f"/ui/runs/{run.run_id}/cancel", data={"csrf": "é"})
    assert resp.status == 403 and "csrf" in await resp.text()
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.PAUSED_OPERATOR


async def test_console_a_session_cookie_that_is_not_ascii_is_not_a_login(api: Api) -> None:
    """A cookie this console never wrote (a signature or payload that is not ASCII, or not
    UTF-8 at all) is no session: the page shows, not logged in, never a 500."""
    for cookie in ("abc.é".encode(), b"\xff\xfe.abc", b"abc.\xff"):
        answer = await raw_http(
            api,
            b"GET /ui/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Cookie: runfleet_session=" + cookie + b"\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 200 "), (cookie, answer[:300])


async def test_console_live_run_page_shows_the_problem_and_keeps_trying_when_nats_fails(
    api: Api, monkeypatch: Any
) -> None:
    """A nats-py error out of a render (the delivery log's read) is the `problem` fragment,
    and the stream keeps rendering: once NATS answers again the problem is cleared."""
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    real = ui_runs.read_deliveries
    nats_down = asyncio.Event()

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if nats_down.is_set():
            raise nats.errors.ConnectionClosedError()
        return await real(*args, **kwargs)

    monkeypatch.setattr(ui_runs, "read_deliveries", flaky)
    async with api.client.get(f"/ui/runs/{run.run_id}/live") as resp:
        assert await read_event(resp, "problem", "") == ""  # the first render: no problem
        nats_down.set()
        problem = await read_event(resp, "problem", "nats_unavailable")
        assert "retrying" in problem
        nats_down.clear()
        assert await read_event(resp, "problem", "") == ""  # it kept trying, and it works


async def test_console_a_run_asking_again_at_a_new_attempt_gets_its_actions_redrawn(
    api: Api,
) -> None:
    """Answered elsewhere, a run that asks its next question is `paused_waiting_human` again:
    the page kept the first question's form, since only a change of status redrew it."""
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR, attempt=1)
    url = f"/ui/runs/{run.run_id}/live?status=paused_operator:1"
    async with api.client.get(url) as resp:
        await read_event(resp, "summary", "")  # drawn as the page was: no actions sent
        await api.env.store.update_run(run.run_id, [], Update(set={"attempt": 2}))
        actions = await read_event(resp, "actions", "", within=10)
        assert actions.strip()


async def test_console_a_run_page_opens_with_nats_down_showing_its_events(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run, its questions and its actions are in the store; only the delivery log is on
    NATS. The page was a 503 during an outage while the API answered the same run."""
    run = await put_run(api.env.store, status=RunStatus.PAUSED_OPERATOR)
    await api.env.store.append_event(run.run_id, "run_paused", {}, attempt=run.attempt)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise NatsUnavailable("cannot reach NATS at nats://127.0.0.1:1: NoServersError()")

    monkeypatch.setattr(ops, "timeline_batches", down)
    resp = await api.client.get(f"/ui/runs/{run.run_id}")
    html = await resp.text()
    assert resp.status == 200, html[:500]
    assert "delivery log not shown (nats_unavailable" in html
    assert 'data-type="run_paused"' in html


async def test_console_the_delivery_log_read_raises_the_typed_nats_error(api: Api) -> None:
    """`read_deliveries` translates nats-py's errors at its boundary (`publisher.nats_errors`),
    so every caller meets `nats_unavailable`, `nats_timeout`, … and never a raw nats type."""

    class DownJetStream:
        async def get_msg(self, *args: Any, **kwargs: Any) -> Any:
            raise nats.errors.ConnectionClosedError()

    with pytest.raises(NatsUnavailable, match="delivery log"):
        await read_deliveries(cast(JetStreamContext, DownJetStream()), api.fleet.names, "some-run")


def test_console_loopback_host_accepts_only_loopback_names_with_any_port() -> None:
    for host in ("127.0.0.1", "127.0.0.1:8470", "localhost", "LOCALHOST:1", "[::1]", "[::1]:80"):
        assert loopback_host(host), host
    for host in (
        "evil.example",
        "evil.example:8470",
        "127.0.0.1.evil.example",
        "localhost.evil.example:8470",
        "127.0.0.1:80:80",
        "127.0.0.1:x",
        "[::1]x",
        "[::2]:80",
        "",
    ):
        assert not loopback_host(host), host


async def test_console_open_reads_refuse_a_host_that_is_not_loopback(api: Api) -> None:
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 reaches the
    loopback console under its own Host. Reads need no login there only because nobody else
    can connect, so a Host that is not a loopback name is refused (typed 403); the test client
    itself (Host 127.0.0.1:<port>) and `localhost` are not."""
    await put_run(api.env.store, status=RunStatus.FINISHED)
    for host in (b"evil.example:8470", b"evil.example", b"10.0.0.1"):
        answer = await raw_http(
            api, b"GET /ui/runs HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 403 "), (host, answer[:300])
        assert b"host_not_loopback" in answer
    for host in (b"localhost:8470", b"[::1]:8470"):
        answer = await raw_http(
            api, b"GET /ui/runs HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200 "), (host, answer[:300])
    status, _ = await get_html(api.client, "/ui/runs")
    assert status == 200
    # Bound beyond loopback every read needs a login anyway: the rule is not needed there.
    async with TestClient(TestServer(create_app(api.env, TOKENS, open_reads=False))) as client:
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"GET /ui/runs HTTP/1.1\r\nHost: console.example\r\n\r\n")
        await writer.drain()
        answer = await reader.read(4096)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 303 "), answer[:300]
