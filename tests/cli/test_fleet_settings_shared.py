"""A command in another shell acts with the settings `runfleet up` runs with (ADR-0019).

Found by an operator walkthrough: with a fleet started with `RUNFLEET_MAX_DELIVER=3`, a plain
`runfleet sweep` in another shell was `consumer_mismatch` (exit 1), and `runfleet streams
ensure` — its remedy — rewrote the live consumer to the default 10, after which every runner
`up` restarted refused to start, restarted by `up` in a tight loop whose view showed no reason.
The session fleet runs with `RUNFLEET_MAX_DELIVER=2` and short leases (`FAST`), so a shell that
sets only `RUNFLEET_DATA` is that other shell."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from publisher.config import WireSettings
from tests.cli.conftest import Up, eventually, runfleet_with, stop_cleanly


def bare_shell(data: Path, **settings: str) -> dict[str, str]:
    """Another shell: no RUNFLEET_* but the data dir (and what the test names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    return {**env, "RUNFLEET_DATA": str(data), **settings}


def test_sweep_and_streams_ensure_in_another_shell_use_the_fleets_settings(fleet: Up) -> None:
    shell = bare_shell(fleet.data)

    swept = runfleet_with(shell, "sweep", "--json")
    ensured = runfleet_with(shell, "streams", "ensure", "--json")

    assert swept.returncode == 0, (swept.stdout, swept.stderr)
    assert ensured.returncode == 0, (ensured.stdout, ensured.stderr)
    report = json.loads(ensured.stdout)
    assert report["updated"] == [] and report["changes"] == {}  # the live consumer kept
    # What `up` shares: no secret, nothing of how the fleet is found.
    shared = json.loads((fleet.data / "fleet-settings.json").read_text())["settings"]
    assert shared["RUNFLEET_MAX_DELIVER"] == "2"
    assert "RUNFLEET_DATA" not in shared and "RUNFLEET_NATS_URL" not in shared


def test_a_runner_whose_settings_contradict_the_consumer_is_restarted_later_with_its_reason(
    tmp_path: Path,
) -> None:
    """An operator changes the consumer on purpose (their shell's value wins); the runner `up`
    restarts then refuses (exit 2, a usage error), and `up` says why and waits between tries;
    once the consumer is put back, the runner starts again."""
    up = Up.start(tmp_path, runners=1)
    try:
        changed = runfleet_with(bare_shell(up.data, RUNFLEET_MAX_DELIVER="5"), "streams", "ensure")
        assert changed.returncode == 0, changed.stderr
        assert "max_deliver 2 -> 5" in changed.stdout
        assert "refuses to start again (consumer_mismatch)" in changed.stderr

        (pid,) = up.runner_pids()
        os.kill(pid, signal.SIGKILL)

        def refused() -> str | None:
            # `up`'s view (a status line every 10 s without a terminal) says why and when.
            lines = [ln for ln in up.output().splitlines() if "[consumer_mismatch]" in ln]
            return next((ln for ln in lines if "restart in" in ln), None)

        line = eventually(refused, within=60, what="up's view showing the refusal")
        assert "runner 0  not running: exit 2 [consumer_mismatch]" in line
        assert "RUNFLEET_MAX_DELIVER here: 2" in line

        put_back = runfleet_with(bare_shell(up.data), "streams", "ensure")  # the fleet's own value
        assert put_back.returncode == 0 and "max_deliver 5 -> 2" in put_back.stdout
        eventually(lambda: len(up.ready_lines(0)) >= 2, within=90, what="the runner back")
    finally:
        stop_cleanly(up)

    # An `up` started again with another value changes the consumer too, and says so.
    again = Up.start(
        tmp_path,
        runners=1,
        extra={"RUNFLEET_MAX_DELIVER": "3"},
        expect=[(WireSettings, "max_deliver", 3)],
    )
    try:
        said = "runfleet up: updated RUNFLEET_RUNS/runfleet-runners: max_deliver 2 -> 3"
        # Said once `up` has started its runners, which may be ready before it says it.
        eventually(lambda: said in again.output(), within=30, what="up saying what it changed")
    finally:
        stop_cleanly(again)


def test_a_setting_taken_from_the_fleets_file_is_named_with_that_file_not_told_to_unset(
    tmp_path: Path,
) -> None:
    """A value this shell never set cannot be unset here: the error names the file it came
    from and says how to override it or change the fleet's own (found by an operator
    walkthrough: "or unset it" for a value `fleet-settings.json` supplied)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "fleet-settings.json").write_text(
        json.dumps({"settings": {"RUNFLEET_STORE_URL": "bogus://x"}})
    )
    taken = runfleet_with(bare_shell(data), "runs")
    own = runfleet_with(bare_shell(data, RUNFLEET_STORE_URL="bogus://y"), "runs")

    assert taken.returncode == 2, taken.stderr
    assert f"came from {(data / 'fleet-settings.json').resolve()}" in taken.stderr
    assert "unset it" not in taken.stderr
    assert "in this shell" in taken.stderr and "restart `up`" in taken.stderr
    # The shell's own value is still told "unset it", and the file is not blamed.
    assert own.returncode == 2, own.stderr
    assert "unset it" in own.stderr and "fleet-settings.json" not in own.stderr
