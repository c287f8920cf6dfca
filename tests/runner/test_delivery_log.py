"""The delivery log (SPEC v2.2 §10b): each disposition a runner makes (and each claim) is a
fire-and-forget message on `runfleet.deliveries.<run_id>` in `RUNFLEET_DELIVERIES`, never a
write on the run (§13.2); `runfleet events RUN --deliveries` merges it with the run's events.
Real nats-server, real SQLite store, in-process runners; the CLI as a subprocess."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path

import nats
import pytest
from nats.js.api import RetentionPolicy, StorageType

from engine.local import new_run_id
from publisher import WireNames, WireSettings, ensure_streams
from runner.backstop import Backstop
from runner.delivery_log import (
    UNATTRIBUTED,
    DeliveryEntry,
    DeliveryLog,
    encode_entry,
    read_deliveries,
)
from runner.runner import Runner
from store import RunStatus, utcnow
from store.timeutil import from_ms
from tests.runner.callables import (
    body,
    bound_drain,
    entered,
    idle_runner,
    lease,
    new_run,
    open_fleet,
    publish_raw,
    release,
    workflow,
)
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import run_cli
from tests.support.nats_server import NatsServer

S = RunStatus
SEVEN_DAYS_S = 7 * 24 * 3600.0


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def runner(fleet: Fleet) -> Runner:
    return await fleet.start_runner(sweeper=False, backstop=False)


async def log_of(fleet: Fleet, run_id: str) -> list[DeliveryEntry]:
    return [entry for _, entry in await read_deliveries(fleet.js, fleet.names, run_id)]


async def wait_log(
    fleet: Fleet, run_id: str, done: Callable[[list[DeliveryEntry]], bool], within: float = 15.0
) -> list[DeliveryEntry]:
    """Poll the run's log until `done` holds (the publish is fire-and-forget)."""

    async def probe() -> list[DeliveryEntry] | None:
        entries = await log_of(fleet, run_id)
        return entries if done(entries) else None

    return await eventually(probe, within=within)


def actions(entries: list[DeliveryEntry]) -> list[tuple[str, str]]:
    return [(e.action, e.reason) for e in entries]


async def publish(
    fleet: Fleet, run_id: str, attempt: int, published_at: datetime | None = None
) -> int:
    ack = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(run_id, attempt, published_at=published_at),
        run_id=run_id,
        attempt=attempt,
    )
    return int(ack.seq)


async def test_a_launched_runs_delivery_log_shows_its_claim_and_its_ack(
    fleet: Fleet, runner: Runner
) -> None:
    run = await fleet.launch(workflow("hello").source)
    done = await fleet.wait_status(run.run_id, "finished")
    assert done.publication is not None
    seq = done.publication.stream_seq
    entries = await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    assert actions(entries) == [("claim", "fresh"), ("ack", "finished")]
    for entry in entries:
        assert (entry.run_id, entry.stream_seq, entry.num_delivered) == (run.run_id, seq, 1)
        assert (entry.attempt, entry.runner, entry.v) == (1, runner.owner, 1)
        assert entry.delay is None and entry.record_id is None
    assert entries[0].at <= entries[1].at


async def test_a_claim_is_logged_but_counted_only_by_the_claims_metric_not_as_a_disposition(
    fleet: Fleet, runner: Runner
) -> None:
    """One call for every log line (`DeliveryLog.disposed`): a disposition is counted in
    `runfleet_deliveries_total` (SPEC §5.8), a claim is not (the claims metric counts it)."""
    run = await fleet.launch(workflow("hello").source)
    await fleet.wait_status(run.run_id, "finished")
    await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    sample = runner.metrics.registry.get_sample_value
    assert sample("runfleet_deliveries_total", {"disposition": "ack", "reason": "finished"}) == 1
    assert sample("runfleet_deliveries_total", {"disposition": "claim", "reason": "fresh"}) is None
    assert sample("runfleet_claims_total", {"path": "fresh", "outcome": "won"}) == 1


async def test_a_transient_failure_is_logged_as_a_nak_with_its_delay(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    run = await fleet.launch(
        workflow("flaky").source, {"dir": str(gates), "failures": 1, "code": "SANDBOX_LOST"}
    )
    await fleet.wait_status(run.run_id, "finished")
    entries = await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    assert actions(entries) == [
        ("claim", "fresh"),
        ("nak", "transient"),
        ("claim", "auto_retry"),
        ("ack", "finished"),
    ]
    nak = entries[1]
    assert nak.delay is not None
    assert nak.delay == pytest.approx(0.2)  # RUNFLEET_TRANSIENT_DELAY, the ladder's first step
    assert [e.num_delivered for e in entries] == [1, 1, 2, 2]
    # The redelivery came after the delay the log names.
    assert (entries[2].at - nak.at).total_seconds() >= nak.delay - 0.01


async def test_a_transient_failure_at_the_last_delivery_is_logged_with_its_dlq_record(
    tmp_path: Path, nats_server: NatsServer, gates: Path
) -> None:
    async with open_fleet(tmp_path / "small", nats_server, max_deliver=2) as small:
        await small.start_runner(sweeper=False, backstop=False)
        run = await small.launch(workflow("flaky").source, {"dir": str(gates)})
        entries = await wait_log(small, run.run_id, lambda es: ("ack", "dlq_parked") in actions(es))
        parked = await small.wait_status(run.run_id, "failed_resumable")
        assert parked.failure_code == "DLQ_PARKED"
        assert actions(entries) == [
            ("claim", "fresh"),
            ("nak", "transient"),
            ("claim", "auto_retry"),
            ("ack", "dlq_parked"),
        ]
        last = entries[-1]
        assert last.num_delivered == 2 and last.record_id == last.stream_seq
        assert (await small.dlq.get(last.stream_seq)).reason == "retries_exhausted"


async def test_a_superseded_delivery_is_logged_and_writes_nothing_on_its_run(
    fleet: Fleet, runner: Runner
) -> None:
    """§13.2: a superseded delivery writes nothing on its run — the log is not the run."""
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED, attempt=2))
    before = await fleet.store.get_run(run_id)
    seq = await publish(fleet, run_id, 1)
    [entry] = await wait_log(fleet, run_id, lambda es: bool(es))
    assert (entry.action, entry.reason) == ("ack", "superseded")
    assert (entry.stream_seq, entry.attempt, entry.num_delivered) == (seq, 1, 1)
    after = await fleet.store.get_run(run_id)
    assert after == before and after.version == before.version
    assert await fleet.store.read_events(run_id) == []


async def test_a_duplicate_delivery_is_logged_and_writes_nothing_on_its_run(
    fleet: Fleet, runner: Runner
) -> None:
    """§13.2: a second copy of a live execution's attempt is acked `duplicate`, logged, and
    writes nothing. The owner's lease is long (no refresh writes during the test)."""
    run_id = new_run_id()
    owner = lease(1, stream_seq=10**9, ttl=60.0)  # the owner claimed another copy
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.RUNNING, lease=owner))
    before = await fleet.store.get_run(run_id)
    seq = await publish(fleet, run_id, 1)
    [entry] = await wait_log(fleet, run_id, lambda es: bool(es))
    assert (entry.action, entry.reason) == ("ack", "duplicate")
    assert (entry.stream_seq, entry.attempt) == (seq, 1)
    after = await fleet.store.get_run(run_id)
    assert after == before and after.version == before.version
    assert await fleet.store.read_events(run_id) == []


async def test_a_dead_lettered_poison_message_is_logged_as_dlq_with_its_record_id(
    fleet: Fleet, runner: Runner
) -> None:
    # A message for no run, older than a lagging read: `run_not_found`, logged under its run id.
    lost = str(uuid.uuid4())
    old = utcnow() - timedelta(minutes=5)
    seq = await publish(fleet, lost, 1, published_at=old)
    [entry] = await wait_log(fleet, lost, lambda es: bool(es))
    assert (entry.action, entry.reason, entry.record_id) == ("dlq", "run_not_found", seq)
    assert (await fleet.dlq.get(seq)).id == entry.record_id
    # Bytes that are no message at all: no run id, so logged under the unattributed subject.
    junk = await publish_raw(fleet.js, fleet.names.runs_subject, b"\xff not json")
    [poison] = await wait_log(
        fleet, UNATTRIBUTED, lambda es: any(e.stream_seq == junk.seq for e in es)
    )
    assert (poison.action, poison.reason, poison.record_id) == ("dlq", "malformed", junk.seq)
    assert poison.run_id is None and poison.attempt is None
    assert (await fleet.dlq.get(junk.seq)).reason == "malformed"


async def test_a_run_id_too_long_for_a_subject_is_logged_unattributed_and_the_runner_serves_on(
    fleet: Fleet, runner: Runner
) -> None:
    """A 20 000-character run id is one valid subject token, and a subject that long is past
    nats-server's control-line limit (4 KiB): the server answers `-ERR` and nats-py *closes*
    the connection for good (no reconnect), so a runner that put the id in the log's subject
    died on one poison message (found by the poison fuzz). Such an id is logged under the
    unattributed subject, with the id in the entry, and the runner goes on serving."""
    long_id = "x" * 20_000
    seq = await publish(fleet, long_id, 1, published_at=utcnow() - timedelta(minutes=5))
    junk = await publish_raw(fleet.js, fleet.names.runs_subject, b"\xff not json")
    logged = await wait_log(
        fleet, UNATTRIBUTED, lambda es: {seq, junk.seq} <= {e.stream_seq for e in es}
    )
    [entry] = [e for e in logged if e.stream_seq == seq]
    assert (entry.action, entry.reason, entry.run_id) == ("dlq", "run_not_found", long_id)
    assert (await fleet.dlq.get(seq)).reason == "run_not_found"
    # `events --deliveries` for that id reads its own entry, not the other unattributed ones.
    own = await read_deliveries(fleet.js, fleet.names, long_id)
    assert [(e.stream_seq, e.run_id) for _, e in own] == [(seq, long_id)]
    assert runner.svc is not None and runner.svc.nc.is_connected
    run = await fleet.launch(workflow("hello").source)  # and the runner still runs runs
    await fleet.wait_status(run.run_id, "finished")


async def test_a_drained_execution_is_logged_as_a_handoff_and_its_new_attempt_as_a_claim(
    fleet: Fleet, gates: Path
) -> None:
    a = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.launch(workflow("hold").source, {"dir": str(gates)})

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    await a.shutdown()  # the drain: RUNNER_INTERRUPTED, then a handoff as attempt 2
    release(gates, run.run_id)
    b = await fleet.start_runner(sweeper=False, backstop=False)
    await fleet.wait_status(run.run_id, "finished")
    entries = await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    assert [(e.action, e.reason, e.attempt, e.runner) for e in entries] == [
        ("claim", "fresh", 1, a.owner),
        ("handoff", "drain", 1, a.owner),
        ("claim", "auto_retry", 2, b.owner),
        ("ack", "finished", 2, b.owner),
    ]
    # The handoff spent no delivery budget: the new attempt's message is a first delivery.
    assert [e.num_delivered for e in entries] == [1, 1, 1, 1]
    assert entries[0].stream_seq == entries[1].stream_seq != entries[2].stream_seq


async def test_the_backstops_dlq_record_is_logged_with_its_record_id(fleet: Fleet) -> None:
    idle = await idle_runner(fleet, owner="backstop-log")
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED))
    seq = await publish(fleet, run_id, 1)  # left in the stream, as after max deliveries
    assert await Backstop(idle.svc).settle(seq) == ("parked", None)
    [entry] = await wait_log(fleet, run_id, lambda es: bool(es))
    assert (entry.action, entry.reason, entry.record_id) == ("dlq", "max_deliveries", seq)
    assert (entry.stream_seq, entry.num_delivered) == (seq, fleet.wire.max_deliver)
    assert entry.runner == "backstop:backstop-log"


async def test_events_deliveries_json_merges_the_runs_events_and_its_log_in_time_order(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    run = await fleet.launch(
        workflow("flaky").source, {"dir": str(gates), "failures": 1, "code": "SANDBOX_LOST"}
    )
    await fleet.wait_status(run.run_id, "finished")
    await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    result = await run_cli(fleet, "events", run.run_id, "--deliveries", "--json")
    assert result.returncode == 0, result.stderr
    timeline = json.loads(result.stdout)["events"]
    times = [datetime.fromisoformat(item["at"]) for item in timeline]
    assert times == sorted(times)
    events = [item for item in timeline if item["source"] == "event"]
    logged = [item for item in timeline if item["source"] == "delivery"]
    stored = await fleet.store.read_events(run.run_id)
    assert [e["seq"] for e in events] == [e.seq for e in stored]  # every event, in seq order
    assert [(d["action"], d["reason"]) for d in logged] == [
        ("claim", "fresh"),
        ("nak", "transient"),
        ("claim", "auto_retry"),
        ("ack", "finished"),
    ]

    def where(pred: Callable[[dict[str, object]], bool]) -> int:
        return next(i for i, item in enumerate(timeline) if pred(item))

    scheduled = where(lambda i: i.get("type") == "run_retry_scheduled")
    nak = where(lambda i: i.get("action") == "nak")
    second_claim = where(lambda i: i.get("reason") == "auto_retry")
    finished = where(lambda i: i.get("type") == "run_finished")
    ack = where(lambda i: i.get("action") == "ack")
    assert scheduled < nak < second_claim < finished < ack
    assert timeline[nak]["delay"] == pytest.approx(0.2)
    # The text view says the same in one line per entry.
    text = await run_cli(fleet, "events", run.run_id, "--deliveries")
    assert text.returncode == 0, text.stderr
    assert "nak transient" in text.stdout and "delay=0.2s" in text.stdout
    assert "run_retry_scheduled" in text.stdout


async def test_streams_ensure_creates_the_delivery_log_with_the_configured_max_age(
    fleet: Fleet,
) -> None:
    # The fleet's own ensure: the default max age, 7 days.
    cfg = (await fleet.js.stream_info(fleet.names.delivery_stream)).config
    assert cfg.subjects == [fleet.names.delivery_subject("*")]
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.storage == StorageType.FILE
    assert cfg.max_age == pytest.approx(SEVEN_DAYS_S)
    # `runfleet streams ensure` reads RUNFLEET_DELIVERY_LOG_TTL.
    other = WireNames(f"t{uuid.uuid4().hex[:16]}")
    result = await run_cli(
        fleet,
        "streams",
        "ensure",
        env={"RUNFLEET_NAMESPACE": other.namespace, "RUNFLEET_DELIVERY_LOG_TTL": "2h"},
    )
    assert result.returncode == 0, result.stderr
    cfg = (await fleet.js.stream_info(other.delivery_stream)).config
    assert cfg.max_age == pytest.approx(7200.0)
    assert cfg.retention == RetentionPolicy.LIMITS


async def test_a_changed_delivery_log_ttl_updates_the_stream_in_place(fleet: Fleet) -> None:
    short = fleet.wire.model_copy(update={"delivery_log_ttl": timedelta(seconds=60)})
    report = await ensure_streams(fleet.js, fleet.names, short)
    assert report.updated == [fleet.names.delivery_stream]
    cfg = (await fleet.js.stream_info(fleet.names.delivery_stream)).config
    assert cfg.max_age == pytest.approx(60.0)
    assert cfg.duplicate_window is not None and cfg.duplicate_window <= 60.0


async def test_a_failed_log_publish_never_raises(nats_server: NatsServer) -> None:
    """The log is evidence, not state: a publish on a closed connection is swallowed."""
    nc = await nats.connect(nats_server.url)
    await nc.close()
    log = DeliveryLog(nc, WireNames("tclosed"), "test")
    await log.record("some-run", 1, 1, "ack", "finished")


def test_the_delivery_log_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="RUNFLEET_DELIVERY_LOG_TTL"):
        WireSettings(delivery_log_ttl="0s")


@pytest.mark.parametrize(
    "fields",
    [
        {"run_id": "r-1", "attempt": 2, "action": "nak", "reason": "transient", "delay": 7.5},
        {"run_id": None, "attempt": None, "action": "dlq", "reason": "malformed", "record_id": 9},
        {"run_id": "déjà-vu", "attempt": 1, "action": "claim", "reason": "fresh"},
    ],
    ids=["nak", "dlq-unattributed", "non-ascii"],
)
def test_an_entry_is_written_as_the_very_json_its_model_writes(fields: dict[str, object]) -> None:
    """The log's writer skips the model (issue 19); the bytes it sends are the model's own."""
    entry = {
        "v": 1,
        "stream_seq": 41,
        "num_delivered": 3,
        "delay": None,
        "record_id": None,
        "runner": "runner-a",
        **fields,
    }
    entry = {name: entry[name] for name in DeliveryEntry.model_fields if name != "at"}
    # A whole second too: orjson wrote `…:11Z` where the model writes `…:11.000000Z` (a review).
    for at in (utcnow(), from_ms(1_764_950_411_000)):
        entry["at"] = at
        written = encode_entry(entry)
        assert written == DeliveryEntry(**entry).model_dump_json().encode()  # type: ignore[arg-type]
    assert b'"at":"2025-12-05T16:00:11.000000Z"' in written


def test_an_entry_orjson_refuses_is_still_written_and_names_its_run() -> None:
    at = utcnow()
    entry = {"v": 1, "run_id": "x\ud800", "stream_seq": 1, "num_delivered": 1, "attempt": None}
    entry |= {"action": "dlq", "reason": "malformed", "delay": None, "record_id": 2}
    entry |= {"runner": "runner-a", "at": at}
    written = json.loads(encode_entry(entry))
    assert written["run_id"] == "x\ud800" and written["record_id"] == 2


async def test_events_after_n_with_deliveries_leaves_out_the_deliveries_before_event_n(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    """`--after N` means "what happened after event N" for both sources (a newcomer found the
    whole delivery log printed after the later events)."""
    run = await fleet.launch(
        workflow("flaky").source, {"dir": str(gates), "failures": 1, "code": "SANDBOX_LOST"}
    )
    await fleet.wait_status(run.run_id, "finished")
    await wait_log(fleet, run.run_id, lambda es: ("ack", "finished") in actions(es))
    stored = await fleet.store.read_events(run.run_id)
    scheduled = next(e for e in stored if e.type == "run_retry_scheduled")
    # An entry stamped in that event's own millisecond: the merge puts it after the event, so
    # it is after it here too (a review: `>` dropped it).
    tie = {
        **{name: None for name in DeliveryEntry.model_fields},
        "v": 1,
        "run_id": run.run_id,
        "stream_seq": 1,
        "num_delivered": 1,
        "attempt": 1,
        "action": "claim",
        "reason": "same_millisecond",
        "runner": "test",
        "at": scheduled.at,
    }
    await fleet.js.publish(
        fleet.names.delivery_subject(run.run_id),
        encode_entry(tie),
        stream=fleet.names.delivery_stream,
    )
    result = await run_cli(
        fleet, "events", run.run_id, "--deliveries", "--after", str(scheduled.seq), "--json"
    )
    assert result.returncode == 0, result.stderr
    timeline = json.loads(result.stdout)["events"]
    events = [item for item in timeline if item["source"] == "event"]
    logged = [(d["action"], d["reason"]) for d in timeline if d["source"] == "delivery"]
    assert events and all(e["seq"] > scheduled.seq for e in events)
    assert ("claim", "fresh") not in logged  # the first claim came before that event
    assert ("claim", "same_millisecond") in logged
    # (appended last to the log, so the merge, which keeps the log's order, puts it last)
    assert logged[-3:-1] == [("claim", "auto_retry"), ("ack", "finished")]
