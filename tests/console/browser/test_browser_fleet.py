"""The fleet page in Chromium (SPEC v2.2 §10b): runners with their slots in use, the leases
runs hold with their expiry, the work consumer's lag and ack-pending — live."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, expect

from tests.cli.conftest import HOLD, eventually
from tests.console.browser.conftest import Console, shot


def test_browser_fleet_page_shows_runners_slots_leases_and_the_consumer(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    run_id = console.launch(HOLD, release=str(release))
    operator.goto("/ui/fleet")
    lease = operator.locator(f'#leases tr[data-run="{run_id}"]')
    expect(lease).to_contain_text("in ")
    expect(operator.locator("#runners tbody tr")).to_have_count(console.up.runners)
    expect(operator.locator("#runners")).to_contain_text("1 / 4")
    expect(operator.locator("#consumer-ack-pending")).to_contain_text("1 delivered")
    expect(operator.locator("#consumer-lag")).to_contain_text("0 message")
    shot(operator, tmp_path, "fleet")

    release.touch()
    expect(lease).to_have_count(0)  # live: the run finished and gave its lease back
    expect(operator.locator("#consumer-ack-pending")).to_contain_text("0 delivered")


def test_up_shows_the_console_url_in_its_live_view(console: Console) -> None:
    line = f"  console on {console.url}/ui/"
    # once when it listens, then in every redraw of the view (every 10 s without a terminal)
    eventually(
        lambda: console.up.output().count(line) >= 2, within=40, what="the URL in the live view"
    )
    view = console.up.output().rsplit("runs: ", 1)[1]
    assert line in view.splitlines()
