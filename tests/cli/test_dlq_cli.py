"""`runfleet dlq list|show|replay|purge` (SPEC §10, §3 DLQ records, §4 Replay) against the
embedded fleet: what a runner cannot decode is kept as raw bytes; a run whose transient failure
exhausts its deliveries (`RUNFLEET_MAX_DELIVER=2`) is parked `DLQ_PARKED` with a record that an
operator replays, once the cause is fixed, as a fresh attempt through the queue."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import RUNFLEET, TEMPFAIL, StorePeek, Up, eventually, write_workflow

POISON = b"\xff\xfe not a runfleet message {"


@dataclass
class Parked:
    run_id: str
    fix: Path
    record_id: int
    attempt: int


def launch_many(fleet: Up, workflow: Path, var_sets: list[str]) -> list[str]:
    """Launch one run per `k=v` in parallel (each `runfleet` process costs a second of
    start-up); returns the run ids in order."""
    procs = [
        subprocess.Popen(
            [str(RUNFLEET), "launch", str(workflow), "--var", pair, "--json"],
            env=fleet.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pair in var_sets
    ]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        ids.append(json.loads(out)["run_id"])
    return ids


def park(fleet: Up, workdir: Path, count: int) -> list[Parked]:
    """`count` runs of a node that exits 75 until its fix file exists: each fails transiently
    on both deliveries and is parked failed_resumable DLQ_PARKED with a record."""
    workflow = write_workflow(workdir, "tempfail", TEMPFAIL)
    fixes = [workdir / f"fix-{i}" for i in range(count)]
    run_ids = launch_many(fleet, workflow, [f"fix={f}" for f in fixes])

    def all_parked() -> dict[str, dict[str, Any]] | None:
        page = fleet.ok("runs", "--status", "failed_resumable", "--code", "DLQ_PARKED")
        found = {r["run_id"]: r for r in page["runs"] if r["run_id"] in run_ids}
        return found if len(found) == count else None

    runs = eventually(all_parked, within=60, every=0.3, what=f"{count} runs DLQ_PARKED")
    records = {r["run_id"]: r for r in fleet.records() if r["run_id"] in run_ids}
    parked = []
    for run_id, fix in zip(run_ids, fixes, strict=True):
        run = runs[run_id]
        assert run["cause_code"] == "TOOL_FAILED_TRANSIENT", run
        record = records[run_id]
        assert record["reason"] == "retries_exhausted"
        assert record["replayable"] is True
        assert record["attempt"] == run["attempt"]
        parked.append(Parked(run_id, fix, record["id"], run["attempt"]))
        logs = "".join(fleet.runner_log(i) for i in range(fleet.runners))
        assert f"run {run_id}: parked in the DLQ as record {record['id']} after" in logs
    return parked


def record_ids(fleet: Up) -> set[int]:
    return {r["id"] for r in fleet.records()}


def purge(fleet: Up, *ids: int) -> None:
    if ids:
        fleet.ok("dlq", "purge", *map(str, ids), "--yes")


@pytest.fixture(scope="module")
def poison(fleet: Up) -> Iterator[int]:
    """A message no runner can decode, published raw on the runs subject; its record's id."""
    seq = fleet.publish_raw(POISON)
    eventually(lambda: seq in record_ids(fleet), within=30, every=0.3, what=f"record {seq}")
    yield seq
    purge(fleet, *(record_ids(fleet) & {seq}))


def test_an_undecodable_message_is_recorded_malformed_under_its_stream_sequence(
    fleet: Up, poison: int
) -> None:
    (record,) = [r for r in fleet.records() if r["id"] == poison]
    assert record["reason"] == "malformed"
    assert record["replayable"] is False
    assert record["run_id"] is None
    assert record["body_bytes"] == len(POISON)
    # The runner's log says it too, where an operator looks first.
    logs = "".join(fleet.runner_log(i) for i in range(fleet.runners))
    assert f"DLQ record {poison} (malformed) for run -, delivery 1:" in logs


def test_dlq_show_includes_the_undecodable_body(fleet: Up, poison: int) -> None:
    shown = fleet.ok("dlq", "show", str(poison))
    assert shown["id"] == poison
    assert shown["reason"] == "malformed"
    assert shown["body"]["undecodable"]
    assert base64.b64decode(shown["body"]["raw_b64"]) == POISON
    assert shown["run"] is None
    # A person sees the bytes too, escaped, beside why they do not decode.
    text = fleet.cli("dlq", "show", str(poison)).stdout
    (line,) = [ln for ln in text.splitlines() if ln.startswith("body bytes")]
    assert line.endswith("\\xff\\xfe not a runfleet message {"), line


def test_dlq_show_and_list_print_a_messages_control_characters_escaped(fleet: Up) -> None:
    """A dead message's header and run id come off the wire: printed raw, `ESC[2J` would
    clear the operator's terminal and draw the sender's text."""
    hostile = "\x1b[2J\x1b[31mFAKE: all good\x1b[0m"
    body = json.dumps({"v": 1, "run_id": "\x1b[31mred\r\nX", "attempt": "x"}).encode()
    seq = fleet.publish_raw(body, headers={"X-Esc": hostile, "X-Long": "y" * 5000})
    eventually(lambda: seq in record_ids(fleet), within=30, every=0.3, what=f"record {seq}")
    try:
        shown = fleet.cli("dlq", "show", str(seq)).stdout
        listed = fleet.cli("dlq", "list").stdout
        for text in (shown, listed):
            assert "\x1b" not in text and "\r" not in text, text
        (esc,) = [ln for ln in shown.splitlines() if ln.startswith("header X-Esc")]
        assert esc.endswith("\\x1b[2J\\x1b[31mFAKE: all good\\x1b[0m"), esc
        (long,) = [ln for ln in shown.splitlines() if ln.startswith("header X-Long")]
        assert long.endswith("(4600 more characters)") and len(long) < 600, long
        assert fleet.ok("dlq", "show", str(seq))["headers"]["X-Esc"] == hostile  # JSON: exact
    finally:
        purge(fleet, seq)


def test_replaying_a_record_with_no_run_is_refused_with_exit_3(fleet: Up, poison: int) -> None:
    result = fleet.cli("dlq", "replay", str(poison), "--json")
    assert result.returncode == 3, (result.stdout, result.stderr)
    (outcome,) = json.loads(result.stdout)["results"]
    assert outcome["replayed"] is False
    assert outcome["error"]["code"] == "record_not_replayable"
    assert poison in record_ids(fleet)  # refused: the record stays, to be purged
    # For a person too: the code, the cause and the remedy (SPEC §10).
    text = fleet.cli("dlq", "replay", str(poison))
    assert text.returncode == 3
    assert f"refused  {poison}: [record_not_replayable]" in text.stdout
    assert "  remedy: " in text.stdout


def test_a_replayed_record_finishes_its_run_through_the_queue_and_goes(
    fleet: Up, workdir: Path
) -> None:
    (parked,) = park(fleet, workdir, 1)
    # `status` puts the way back on the screen that says the run is parked (found by an
    # operator walkthrough: no cause, no record id, no next step).
    assert fleet.ok("status", parked.run_id)["dlq_record"] == parked.record_id
    shown = fleet.cli("status", parked.run_id).stdout
    assert "failure   DLQ_PARKED (cause TOOL_FAILED_TRANSIENT): " in shown
    assert f"`runfleet dlq replay {parked.record_id}`" in shown
    parked.fix.touch()  # the operator fixes the cause

    replayed = fleet.ok("dlq", "replay", str(parked.record_id))
    assert replayed["results"] == [
        {
            "id": parked.record_id,
            "run_id": parked.run_id,
            "attempt": parked.attempt + 1,
            "replayed": True,
        }
    ]
    done = fleet.wait_status(parked.run_id, "finished", "failed", "failed_resumable")
    assert done["status"] == "finished", done
    assert done["attempt"] == parked.attempt + 1
    assert done["outputs"]["work"] == "fixed"
    assert parked.record_id not in record_ids(fleet)
    events = fleet.events(parked.run_id)
    queued = [e["data"] for e in events if e["type"] == "run_queued"]
    assert queued[-1] == {"attempt": parked.attempt + 1, "kind": "replay"}
    claims = [(e["attempt"], e["data"]["path"]) for e in events if e["type"] == "run_claimed"]
    assert claims[-1] == (parked.attempt + 1, "fresh")  # a runner claimed it off the queue


def test_purge_removes_only_the_records_it_names(fleet: Up, workdir: Path) -> None:
    first, second = park(fleet, workdir, 2)
    try:
        purged = fleet.ok("dlq", "purge", str(first.record_id), "--yes")
        assert purged == {"removed": [first.record_id]}
        left = record_ids(fleet)
        assert first.record_id not in left
        assert second.record_id in left
        # Purging a record leaves its run parked: nothing else is touched.
        shown = fleet.status(first.run_id)
        assert (shown["failure_code"], shown["dlq_record"]) == ("DLQ_PARKED", None)
        assert fleet.status(second.run_id)["dlq_record"] == second.record_id
        # `status` no longer offers the purged record as the way back (found by review).
        text = fleet.cli("status", first.run_id).stdout
        assert "dlq replay" not in text and "(no DLQ record left)" in text
    finally:
        purge(fleet, *(record_ids(fleet) & {first.record_id, second.record_id}))


def test_purge_all_without_yes_and_no_terminal_is_refused_not_confirmed_and_removes_nothing(
    fleet: Up, poison: int
) -> None:
    before = record_ids(fleet)
    assert poison in before
    result = fleet.cli("dlq", "purge", "--all")  # stdin is closed: the confirmation fails
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "purge" in result.stderr and "[y/N]" in result.stderr  # it asked first
    assert "error [not_confirmed]" in result.stderr and "nothing purged" in result.stderr
    assert "--yes" in result.stderr  # the remedy names the way a script says yes
    assert "Aborted" not in result.stderr and "removed" not in result.stdout

    as_json = fleet.cli("dlq", "purge", "--all", "--json")
    assert as_json.returncode == 3
    assert json.loads(as_json.stdout)["error"]["code"] == "not_confirmed"
    assert record_ids(fleet) == before


# `--all` with the reason every exhausted transient failure records: the module's poison record
# (not replayable) stays out of the bulk replays.
REPLAY_ALL = ("dlq", "replay", "--all", "--reason", "retries_exhausted", "--json")


def kill_replay_all_when(fleet: Up, visible: Callable[[StorePeek], bool]) -> None:
    """Start `runfleet dlq replay --all` and SIGKILL it as soon as `visible` holds in the
    store; it must have been killed, not have finished."""
    peek = fleet.peek()
    proc = subprocess.Popen(
        [str(RUNFLEET), *REPLAY_ALL],
        env=fleet.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        eventually(
            lambda: proc.poll() is not None or visible(peek),
            within=60,
            every=0.0005,  # a replay takes milliseconds: a process start is too slow to watch
            what="the first replay",
        )
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        peek.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the replay ended by itself first: {out} {err}"


def outcome(fleet: Up, parked: list[Parked], within: float) -> dict[str, tuple[Any, ...]]:
    """Per run, once every run finished (or at the deadline): (status, attempt, how many
    times a replay queued it, whether its record is still in the DLQ)."""
    run_ids = [p.run_id for p in parked]

    def statuses() -> dict[str, dict[str, Any]]:
        runs = fleet.ok("runs", "--limit", "10000")["runs"]
        return {r["run_id"]: r for r in runs if r["run_id"] in run_ids}

    def all_finished() -> dict[str, dict[str, Any]] | None:
        runs = statuses()
        return runs if all(r["status"] == "finished" for r in runs.values()) else None

    try:
        runs = eventually(all_finished, within=within, every=0.3, what="every run finished")
    except AssertionError:
        runs = statuses()  # the comparison below shows what is missing
    peek = fleet.peek()
    try:
        kinds = peek.queued_kinds(run_ids)
    finally:
        peek.close()
    left = {r["run_id"] for r in fleet.records()}
    return {
        p.run_id: (
            runs[p.run_id]["status"],
            runs[p.run_id]["attempt"],
            kinds[p.run_id].count("replay"),
            p.run_id in left,
        )
        for p in parked
    }


def expected(parked: list[Parked]) -> dict[str, tuple[Any, ...]]:
    return {p.run_id: ("finished", p.attempt + 1, 1, False) for p in parked}


KILLED_REPLAYS = 6
"""Records a killed bulk replay starts on. With three, a loaded machine (CI's other workers)
let the command replay all of them between the first replay the watcher saw and its SIGKILL,
and there was nothing left to replay; each more record is one more replay's time for the kill
to land in. Six parked runs fit the fleet's eight slots at once."""


def test_a_bulk_replay_killed_halfway_loses_nothing_when_rerun(fleet: Up, workdir: Path) -> None:
    """Killed at the first sign of a replay (its run's attempt moved): the earliest point
    at which a bulk replay is half done."""
    parked = park(fleet, workdir, KILLED_REPLAYS)
    run_ids = [p.run_id for p in parked]
    try:
        for p in parked:
            p.fix.touch()

        def first_replay_visible(peek: StorePeek) -> bool:
            now = peek.attempts(run_ids)
            return any(now[p.run_id] != p.attempt for p in parked)

        kill_replay_all_when(fleet, first_replay_visible)
        assert {p.record_id for p in parked} & record_ids(fleet), "nothing was left to replay"

        rerun = fleet.cli(*REPLAY_ALL)
        assert outcome(fleet, parked, within=30) == expected(parked), rerun.stdout
        assert rerun.returncode == 0, rerun.stdout
    finally:
        purge(fleet, *(record_ids(fleet) & {p.record_id for p in parked}))


def test_a_bulk_replay_killed_after_queueing_a_replay_replays_each_run_once_when_rerun(
    fleet: Up, workdir: Path
) -> None:
    """Killed once a replay is queued and recorded, before (or just after) its record goes:
    the re-run recognises that run as replayed and does not replay it again."""
    parked = park(fleet, workdir, KILLED_REPLAYS)
    run_ids = [p.run_id for p in parked]
    try:
        for p in parked:
            p.fix.touch()

        def first_replay_queued(peek: StorePeek) -> bool:
            return any("replay" in kinds for kinds in peek.queued_kinds(run_ids).values())

        kill_replay_all_when(fleet, first_replay_queued)
        assert {p.record_id for p in parked} & record_ids(fleet), "nothing was left to replay"

        rerun = fleet.cli(*REPLAY_ALL)
        assert outcome(fleet, parked, within=30) == expected(parked), rerun.stdout
        assert rerun.returncode == 0, rerun.stdout
    finally:
        purge(fleet, *(record_ids(fleet) & {p.record_id for p in parked}))


@pytest.mark.timeout(300)  # parking a run takes two deliveries; slow on a loaded machine
def test_dlq_commands_act_for_runfleet_tenant_as_the_api_acts_for_its_tokens_tenant(
    fleet: Up, workdir: Path
) -> None:
    """Found by a tenant-isolation walkthrough: `dlq list`, `show` and `purge` read and removed
    every tenant's records while `dlq replay` acted for `RUNFLEET_TENANT` only (the API scopes
    all four). Another tenant's record is not found (exit 3) and untouched; the listing says
    how many records of other tenants it does not show."""
    (parked,) = park(fleet, workdir, 1)
    bravo = {"RUNFLEET_TENANT": "bravo"}
    try:
        listed = fleet.cli("dlq", "list", "--json", env=bravo)
        assert listed.returncode == 0, listed.stderr
        shown = json.loads(listed.stdout)
        assert parked.record_id not in {r["id"] for r in shown["records"]}
        assert shown["other_tenants"] >= 1
        text = fleet.cli("dlq", "list", env=bravo).stdout
        assert "of other tenants not shown" in text and "RUNFLEET_TENANT" in text

        for args in (
            ("dlq", "show", str(parked.record_id)),
            ("dlq", "purge", str(parked.record_id), "--yes"),
        ):
            refused = fleet.cli(*args, env=bravo)
            assert refused.returncode == 3, (args, refused.stdout, refused.stderr)
            assert "error [record_not_found]" in refused.stderr
            assert "for tenant bravo" in refused.stderr and "RUNFLEET_TENANT" in refused.stderr
        replayed = fleet.cli("dlq", "replay", "--all", "--json", env=bravo)
        assert parked.record_id not in {r["id"] for r in json.loads(replayed.stdout)["results"]}

        assert parked.record_id in record_ids(fleet)  # the default tenant's, untouched
        assert fleet.status(parked.run_id)["failure_code"] == "DLQ_PARKED"
    finally:
        purge(fleet, *(record_ids(fleet) & {parked.record_id}))
