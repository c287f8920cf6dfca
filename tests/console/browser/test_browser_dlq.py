"""The DLQ pages and the delivery timeline in Chromium (SPEC §4 Replay, v2.2 §10b): find a
dead-lettered run's record, see its body decoded, replay it and watch the run finish; purge
only after the confirmation page; a nak delay and a superseded delivery in a run's timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from playwright.sync_api import Page, expect

from publisher.wire import RunMessage
from store import utcnow
from tests.cli.conftest import TEMPFAIL, eventually
from tests.console.browser.conftest import Console, shot


def record_of(console: Console, run_id: str | None = None, reason: str | None = None) -> int:
    def probe() -> dict[str, Any] | None:
        for record in console.records():
            if (run_id is None or record["run_id"] == run_id) and (
                reason is None or record["reason"] == reason
            ):
                return record
        return None

    found = eventually(probe, within=60, every=0.2, what=f"a DLQ record of {run_id or reason}")
    return int(found["id"])


def dead_lettered(console: Console, tmp_path: Path) -> tuple[str, int, Path]:
    """A run whose tool fails transiently on both deliveries (`RUNFLEET_MAX_DELIVER=2`): nak'd
    once with a delay, then dead-lettered. Creating the returned file fixes it."""
    fix = tmp_path / "fixed"
    run_id = console.launch(TEMPFAIL, fix=str(fix))
    record_id = record_of(console, run_id)

    def let_go() -> bool:
        # The record is written before the runner acks the delivery and lets the run go; an
        # action taken in between meets a held run (a resume's message is nak'd `busy`).
        entries = console.api("GET", f"/runs/{run_id}/timeline")["entries"]
        return any(e.get("action") == "ack" and e.get("reason") == "dlq_parked" for e in entries)

    eventually(let_go, within=30, every=0.2, what=f"run {run_id} let go after parking")
    return run_id, record_id, fix


def test_browser_replay_a_dlq_record_and_see_the_run_finish(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id, record_id, fix = dead_lettered(console, tmp_path)
    operator.goto("/ui/dlq")
    row = operator.locator(f'tr[data-record="{record_id}"]')
    expect(row).to_contain_text(run_id[:13])
    shot(operator, tmp_path, "dlq")

    row.locator(f'a[href="/ui/dlq/{record_id}"]').click()
    expect(operator.locator("#body")).to_contain_text(f'"run_id": "{run_id}"')
    shot(operator, tmp_path, "dlq-record")

    fix.touch()
    operator.click("#replay-one button")
    expect(operator.locator("#flash")).to_contain_text(f"record {record_id} → run {run_id[:13]}")
    expect(operator.locator(f'tr[data-record="{record_id}"]')).to_have_count(0)

    operator.goto(f"/ui/runs/{run_id}")
    expect(operator.locator("#run-status")).to_have_text("finished")
    timeline = operator.locator("#timeline")
    parked = timeline.locator('tr[data-reason="dlq_parked"]')
    expect(parked.locator(f'a[href="/ui/dlq/{record_id}"]')).to_be_visible()
    expect(timeline.locator('tr[data-type="run_finished"]')).to_have_count(1)
    assert console.run(run_id)["status"] == "finished"


def test_browser_purge_asks_for_confirmation_then_removes_the_record(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    console.publish_raw(b"{not json")
    record_id = record_of(console, reason="malformed")
    operator.goto("/ui/dlq")
    operator.check(f'tr[data-record="{record_id}"] input[name=id]')
    operator.click("#purge-selected")

    expect(operator.locator(f'#to-purge tr[data-record="{record_id}"]')).to_be_visible()
    shot(operator, tmp_path, "dlq-purge-confirm")
    assert record_id in [r["id"] for r in console.records()]  # asking purged nothing

    operator.click("#confirm-purge button")
    expect(operator.locator("#flash")).to_contain_text(f"purged 1 record(s): {record_id}")
    expect(operator.locator(f'tr[data-record="{record_id}"]')).to_have_count(0)
    assert record_id not in [r["id"] for r in console.records()]


def test_browser_a_nak_delay_and_a_superseded_delivery_are_in_the_run_timeline(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id, _, fix = dead_lettered(console, tmp_path)
    fix.touch()
    console.api("POST", f"/runs/{run_id}/resume", {})
    operator.goto(f"/ui/runs/{run_id}")
    expect(operator.locator("#run-status")).to_have_text("finished")
    timeline = operator.locator("#timeline")
    nak = timeline.locator('tr[data-action="nak"]').first
    expect(nak).to_contain_text("delivery 1")
    expect(nak.locator(".delay")).to_contain_text("delay 0.2 s")

    stale = RunMessage(
        run_id=run_id, tenant="default", attempt=1, kind="launch", published_at=utcnow()
    )
    console.publish_raw(stale.model_dump_json().encode())  # an attempt the run has left
    superseded = timeline.locator('tr[data-reason="superseded"]')
    expect(superseded).to_contain_text("ack · superseded")  # live: no reload
    expect(superseded).to_contain_text("1")
    shot(operator, tmp_path, "run-timeline")
    assert console.run(run_id)["attempt"] == 2


def test_browser_bulk_replay_by_reason_replays_every_record_with_it(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    """Bulk by reason (issue 18 item 2): the DLQ filtered by one reason offers to replay every
    record with it; both dead-lettered runs come back and finish."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = dead_lettered(console, tmp_path / "a")
    second = dead_lettered(console, tmp_path / "b")
    reasons = {r["id"]: r["reason"] for r in console.records()}
    reason = reasons[first[1]]
    assert reasons[second[1]] == reason
    for _, _, fix in (first, second):
        fix.touch()
    operator.goto(f"/ui/dlq?reason={reason}")
    for _, record_id, _ in (first, second):
        expect(operator.locator(f'tr[data-record="{record_id}"]')).to_be_visible()
    operator.click("#bulk-replay button")
    flash = operator.locator("#flash")
    for run_id, record_id, _ in (first, second):
        expect(flash).to_contain_text(f"record {record_id} → run {run_id[:13]} queued")
        expect(operator.locator(f'tr[data-record="{record_id}"]')).to_have_count(0)
    for run_id, _, _ in (first, second):
        eventually(
            lambda run_id=run_id: console.run(run_id)["status"] == "finished",
            within=60,
            every=0.2,
            what=f"run {run_id} finished after the bulk replay",
        )
