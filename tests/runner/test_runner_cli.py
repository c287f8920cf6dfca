"""`runfleet runner` as an operator runs it (SPEC §5.8, §10, §3): a real process that serves
runs launched by `runfleet launch`, exposes its metrics, drains and exits 0 on SIGTERM, and
refuses to start when the shared consumer contradicts its own settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import WORKFLOWS, ledger, released, run_cli, runner_process, spawn_runner


def deliveries_total(metrics_text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["disposition"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "runfleet_deliveries"
        for s in family.samples
        if s.name == "runfleet_deliveries_total"
    }


async def test_runner_command_serves_a_launched_run_to_finished_exposes_metrics_and_exits_0_on_sigterm(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    book = tmp_path / "ledger"
    async with runner_process(fleet, "runner-cli", args=("--slots", "2")) as proc:
        assert proc.slots == 2
        launched = await run_cli(
            fleet,
            "launch",
            str(WORKFLOWS / "one_step.yaml"),
            "--var",
            f"ledger={book}",
            "--json",
        )
        assert launched.returncode == 0, launched.stderr
        run_id = json.loads(launched.stdout)["run_id"]
        await fleet.wait_status(run_id, "finished")
        await eventually(released(fleet, run_id))
        events = await fleet.store.read_events(run_id)
        assert [e.data["runner"] for e in events if e.type == "run_claimed"] == [proc.owner]

        async def acked() -> dict[tuple[str, str], float] | None:
            status, text = await proc.get("/metrics")
            assert status == 200
            counts = deliveries_total(text)
            return counts if sum(counts.values()) > 0 else None

        counts = await eventually(acked)
        assert counts.get(("ack", "finished")) == 1.0
        status, _ = await proc.get("/healthz")
        assert status == 200
        status, _ = await proc.get("/readyz")
        assert status == 200

        ceiling = fleet.engine.unwind_ceiling.total_seconds()
        code = await proc.stop(within=ceiling + 30)  # the deploy's grace (SPEC §5.8)
        assert code == 0, f"exit {code} on SIGTERM; log:\n{proc.log()}"
    assert ledger(book) == {"ran": 1}
    assert await fleet.queue_drained()


async def test_an_idle_runner_exits_0_on_sigterm_well_within_the_unwind_ceiling(
    fleet: Fleet,
) -> None:
    """Nothing to hand off, so nothing to wait for: stop fetching, drain NATS, exit 0. The
    runner first idles through a few empty fetches (each a 0.5 s pull that times out), seen as
    the reset of `/healthz`'s `since_progress_s` at every turn of the fetch loop."""
    async with runner_process(fleet, "runner-idle") as proc:
        turns = 0
        last = 0.0

        async def idled() -> bool:
            nonlocal turns, last
            status, body = await proc.get("/healthz")
            assert status == 200, body
            since = float(json.loads(body)["since_progress_s"])
            turns += since < last
            last = since
            return turns >= 4

        await eventually(idled, within=15)
        ceiling = fleet.engine.unwind_ceiling.total_seconds()
        sent = time.monotonic()
        code = await proc.stop(within=ceiling + 30)
        took = time.monotonic() - sent
    assert code == 0, proc.log()
    assert took < ceiling, f"an idle runner took {took:.1f}s to exit; log:\n{proc.log()}"


@pytest.mark.parametrize(
    ("env", "contradiction"),
    [
        ({"RUNFLEET_MAX_DELIVER": "5"}, "max_deliver 10 (RUNFLEET_MAX_DELIVER here: 5)"),
        ({"RUNFLEET_ACK_WAIT": "9s"}, "ack_wait 3.5s (RUNFLEET_ACK_WAIT"),
    ],
    ids=["max_deliver", "ack_wait"],
)
async def test_runner_whose_settings_contradict_the_consumer_refuses_to_start_with_a_clear_error(
    fleet: Fleet, env: dict[str, str], contradiction: str
) -> None:
    proc = spawn_runner(fleet, fleet.tmp / "runner-mismatch.log", env=env)
    try:
        code = await proc.wait_exit(within=30)
    finally:
        proc.kill()
    log = proc.log()
    assert code == 2, log  # a usage error (SPEC §10): only the settings can mend it
    assert "consumer_mismatch" in log and contradiction in log, log
    assert "`runfleet streams ensure` with the new values" in log
    assert "slots, http :" not in log  # it never started serving
