"""Hostile bodies never reach a crash (SPEC v2.2 §5.1, §5.2 step 1, §13.12).

Whatever the parser or validator raises on a body — a 5 000-digit integer (`ValueError`),
200 000 nested arrays (`RecursionError`), a 4 000-digit timestamp (`OverflowError`), any type,
any size — is `MalformedMessage`, with a short detail. Checked three ways, asserting only the
typed outcomes: `decode` alone (hypothesis, plus every extreme at every field); a real runner's
delivery path (each body dead-lettered `malformed` on its first delivery, never the transient
ladder, and the runner then runs a good run); and the backstop's path (each body left in the
stream at `max_deliver` and recorded `malformed` by the backstop, whose loop then parks a good
run's max-delivered message).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
from hypothesis import HealthCheck, given, settings

from publisher import MalformedMessage, UnsupportedSchema
from publisher.wire import HDR_ATTEMPT, RunMessage, decode
from runner.runner import Runner
from tests.reliability.hostile import (
    BAD_UTF8,
    INT_LIMIT,
    LONE_SURROGATE,
    PATHS,
    Hostile,
    big_int,
    deep,
    hostile_inputs,
    huge_string,
    inject,
    message,
    nats_bodies,
)
from tests.runner.callables import (
    bound_drain,
    idle_runner,
    open_fleet,
    publish_raw,
    sample,
    workflow,
)
from tests.runner.conftest import Fleet, eventually
from tests.runner.conftest import fleet as fleet  # the fixture, shared with tests/runner
from tests.support.nats_server import NatsServer

DETAIL_MAX = 512
"""A `MalformedMessage` says what is wrong in a line, not by echoing the hostile value."""


def typed(body: bytes, headers: dict[str, str] | None = None) -> RunMessage | Exception:
    """`decode`'s outcome; any exception other than the two typed ones propagates (and fails)."""
    try:
        return decode(body, headers)
    except (MalformedMessage, UnsupportedSchema) as exc:
        assert len(exc.message) <= DETAIL_MAX, (
            type(exc).__name__,
            len(exc.message),
            exc.message[:300],
        )
        return exc


# -- decode alone ---------------------------------------------------------------------------------


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(hostile_inputs)
def test_decode_raises_only_typed_errors_with_a_short_detail_on_any_body(
    given_input: tuple[bytes, dict[str, str] | None],
) -> None:
    body, headers = given_input
    typed(body, headers)


EXTREMES: dict[str, bytes] = {
    "int_5000": big_int(5000),
    "int_over_limit": big_int(INT_LIMIT + 1, negative=True),
    "int_4000": big_int(4000),
    "int_4000_negative": big_int(4000, negative=True),
    "deep_200k_arrays": deep(200_000, "arrays"),
    "deep_200k_objects": deep(200_000, "objects"),
    "deep_200k_mixed": deep(200_000, "mixed"),
    "string_3MiB": huge_string(3 * 1024 * 1024),
    "bad_utf8": BAD_UTF8,
    "lone_surrogate": LONE_SURROGATE,
    "nan": b"NaN",
    "infinity": b"-Infinity",
    "float_overflow": b"1e400",
}


def test_decode_turns_what_the_parser_or_validator_raises_into_malformed_at_every_field() -> None:
    """Every extreme at every field of `RunMessage` (and as a duplicate key, and as the whole
    body): a typed outcome each time, and the ones that cannot be a message are malformed."""
    outcomes: dict[str, str] = {}
    for name, raw in EXTREMES.items():
        outcomes[f"{name} as body"] = type(typed(raw)).__name__
        for path in PATHS:
            for duplicate in (False, True):
                body = inject(message(), path, raw, duplicate=duplicate)
                outcomes[f"{name} at {'.'.join(path)}{' (dup)' * duplicate}"] = type(
                    typed(body)
                ).__name__
    # What no parser can read is malformed wherever it sits.
    for name in ("int_5000", "int_over_limit", "deep_200k_arrays", "deep_200k_objects", "bad_utf8"):
        assert {v for k, v in outcomes.items() if k.startswith(f"{name} ")} == {"MalformedMessage"}
    # The fields whose type cannot hold the value are malformed too.
    for field in ("run_id", "tenant", "kind", "published_at"):
        for name in (
            "int_5000",
            "int_4000",
            "deep_200k_mixed",
            "nan",
            "infinity",
            "float_overflow",
        ):
            assert outcomes[f"{name} at {field}"] == "MalformedMessage", (name, field)
    assert outcomes["int_4000 at v"] == "UnsupportedSchema"  # a huge `v` is "newer", bounded
    assert outcomes["int_4000_negative at v"] == "MalformedMessage"
    assert outcomes["int_4000 at attempt"] == "RunMessage"  # valid: the runner judges it
    assert outcomes["lone_surrogate at run_id"] == "MalformedMessage"


def test_decode_attempt_header_disagreeing_with_a_huge_attempt_has_a_short_detail() -> None:
    body = inject(message(), ("attempt",), big_int(INT_LIMIT))
    outcome = typed(body, {HDR_ATTEMPT: "1"})
    assert isinstance(outcome, MalformedMessage)
    outcome = typed(inject(message(), ("attempt",), b"7"), {HDR_ATTEMPT: "9" * 5000})
    assert isinstance(outcome, MalformedMessage)


# -- through a runner -----------------------------------------------------------------------------


async def _publish(fleet: Fleet, bodies: list[Hostile]) -> dict[int, Hostile]:
    sent: dict[int, Hostile] = {}
    for hostile in bodies:
        assert isinstance(typed(hostile.body), MalformedMessage), hostile.name
        ack = await publish_raw(fleet.js, fleet.names.runs_subject, hostile.body)
        sent[int(ack.seq)] = hostile
    return sent


def _loops_alive(runner: Runner, *names: str) -> bool:
    assert runner._tasks is not None
    return all(any(not t.done() for t in runner._tasks.named(f"loop:{name}")) for name in names)


@pytest.mark.timeout(90)
async def test_runner_dead_letters_any_unparseable_body_malformed_at_once_and_keeps_serving(
    fleet: Fleet,
) -> None:
    runner = await fleet.start_runner(sweeper=False, slots=4)
    try:
        await _runner_serves_through(fleet, runner)
    finally:
        bound_drain(fleet.runners)


async def _runner_serves_through(fleet: Fleet, runner: Runner) -> None:
    sent = await _publish(fleet, nats_bodies())

    async def all_recorded() -> bool:
        return {r.id for r in await fleet.dlq.list()} >= set(sent)

    await eventually(all_recorded, within=45, every=0.2)
    for seq, hostile in sent.items():
        rec = await fleet.dlq.get(seq)
        # Straight to the DLQ on the first delivery: not the transient ladder (internal_error).
        assert (rec.reason, rec.num_delivered, rec.runner) == ("malformed", 1, runner.owner), (
            hostile.name,
            rec.reason,
            rec.detail,
        )
        assert len(rec.detail) <= DETAIL_MAX and not rec.replayable, hostile.name
        assert await fleet.dlq.body(rec) == hostile.body, hostile.name
    assert sample(
        runner.metrics.registry, "runfleet_deliveries_total", disposition="dlq", reason="malformed"
    ) == len(sent)
    assert (
        sample(
            runner.metrics.registry,
            "runfleet_deliveries_total",
            outcome="nak",
            reason="internal_error",
        )
        == 0
    )
    # The loops live, and the next good message is processed.
    assert _loops_alive(runner, "fetch", "backstop")
    good = await fleet.launch(workflow("hello").source)
    await fleet.wait_status(good.run_id, "finished", within=30)
    assert _loops_alive(runner, "fetch", "backstop")
    assert await fleet.queue_drained()


# -- through the backstop -------------------------------------------------------------------------


@pytest.fixture
async def small_fleet(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    async with open_fleet(tmp_path / "small", nats_server, max_deliver=2) as small:
        yield small


async def _exhaust_deliveries(fleet: Fleet, seqs: set[int]) -> None:
    """Play a consumer that naks every delivery until the server stops redelivering: each of
    `seqs` then sits in the stream at `max_deliver`, and its MAX_DELIVERIES advisory is out."""
    psub = await fleet.js.pull_subscribe_bind(fleet.names.consumer, stream=fleet.names.runs_stream)
    seen: dict[int, int] = {}
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=32, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            for msg in msgs:
                seen[msg.metadata.sequence.stream] = msg.metadata.num_delivered
                await msg.nak()
    finally:
        await psub.unsubscribe()
    assert {seq: seen.get(seq) for seq in seqs} == dict.fromkeys(seqs, fleet.wire.max_deliver)


@pytest.mark.timeout(90)
async def test_backstop_records_any_unparseable_body_malformed_and_its_loop_survives(
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    runner = await idle_runner(fleet, owner="hostile-backstop", backstop=True)
    sent = await _publish(fleet, nats_bodies())
    await _exhaust_deliveries(fleet, set(sent))

    async def all_recorded() -> bool:
        return {r.id for r in await fleet.dlq.list()} >= set(sent)

    await eventually(all_recorded, within=45, every=0.2)
    for seq, hostile in sent.items():
        rec = await fleet.dlq.get(seq)
        assert (rec.reason, rec.runner) == ("malformed", "backstop:hostile-backstop"), (
            hostile.name,
            rec.reason,
            rec.detail,
        )
        assert rec.num_delivered == fleet.wire.max_deliver and not rec.replayable, hostile.name
        assert await fleet.dlq.body(rec) == hostile.body, hostile.name
    assert _loops_alive(runner, "backstop")

    # The loop lives: a good run's message that reaches max_deliver next is parked by it.
    run = await fleet.launch(workflow("hello").source)
    assert run.publication is not None and run.publication.stream_seq is not None
    await _exhaust_deliveries(fleet, {run.publication.stream_seq})
    parked = await fleet.wait_status(run.run_id, "failed_resumable", within=20)
    assert parked.failure_code == "DLQ_PARKED"
    rec = await fleet.dlq.get(run.publication.stream_seq)
    assert (rec.reason, rec.run_id) == ("max_deliveries", run.run_id)
    assert _loops_alive(runner, "backstop")
    assert await fleet.queue_drained()
