"""`runfleet up` starts its own nats-server again when it dies under the fleet: same port and
JetStream directory, so queued work survives and the runners reconnect; the view and `up`'s
log say what happened (found by an on-call walkthrough: a SIGKILLed server left every runner
retrying forever, the view showing `dlq -1`, and the CLI's remedy pointing at `runfleet up`,
which the running fleet's lock refuses)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.cli.conftest import Up, cmdline, eventually, stop_cleanly

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello.yaml"


def _nats_pid(up: Up) -> int:
    (pid,) = [p for p in up.track() if "nats-server" in cmdline(p)]
    return pid


def test_up_restarts_its_nats_server_on_the_same_port_and_the_fleet_works_on(
    tmp_path: Path,
) -> None:
    up = Up.start(tmp_path / "fleet", runners=1)
    try:
        url, first = up.nats_url, _nats_pid(up)
        queued = up.launch(HELLO)["run_id"]
        up.wait_status(queued, "finished", within=60)
        mark = len(up.output())
        os.kill(first, signal.SIGKILL)
        eventually(
            lambda: "nats-server restarted on port" in up.output()[mark:],
            within=60,
            what="the nats-server restarted",
        )
        assert _nats_pid(up) != first
        assert up.nats_url == url  # the CLI finds it where it was
        out = up.output()[mark:]
        assert "nats-server killed by SIGKILL; restarting it on port" in out
        assert "nats-server killed by SIGKILL" in (up.data / "logs" / "up.log").read_text()
        eventually(
            lambda: (
                "  nats-server  pid" in up.output()[mark:]
                and "(restarts 1, last: killed by SIGKILL)" in up.output()[mark:]
            ),
            within=30,
            what="the view's nats-server row",
        )
        # The streams came back with the server, and the runners reconnected to it.
        after = up.launch(HELLO)["run_id"]
        up.wait_status(after, "finished", within=90)
        assert up.status(queued)["status"] == "finished"
    finally:
        stop_cleanly(up)
