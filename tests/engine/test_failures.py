"""The failure table (SPEC §6.6): one row per code, and the delays the runner naks with."""

from __future__ import annotations

import pytest

from engine.errors import AmbiguousEffect, Permanent, Transient
from engine.failures import (
    RULES,
    FailureClass,
    FailureCode,
    is_auto_resumable,
    nak_delay,
    node_retries_for,
    node_retry_backoff,
    rule_for,
)
from store.models import RunStatus

# SPEC §6.6, transcribed by hand: the table in code must say the same.
SPEC_TABLE: dict[FailureClass, set[str]] = {
    FailureClass.TRANSIENT_NODE: {
        "EXECUTION_FAILED",
        "TIMEOUT",
        "RATE_LIMITED",
        "NETWORK_TRANSIENT",
        "TOOL_FAILED_TRANSIENT",
    },
    FailureClass.TRANSIENT_INFRA: {
        "SANDBOX_SETUP_TIMEOUT",
        "SANDBOX_CAPACITY",
        "SANDBOX_LOST",
        "ATTACHMENTS_UNFETCHABLE",
        "SCRATCH_RESTORE_FAILED",
        "RUNNER_INTERRUPTED",
        "RUNNER_LOST",
        "INTERNAL_ERROR",
    },
    FailureClass.OPERATOR_RESUMABLE: {"DLQ_PARKED", "SCRATCH_NOT_PORTABLE", "AMBIGUOUS_EFFECT"},
    FailureClass.BUDGET: {"BUDGET_EXCEEDED"},
    FailureClass.DETERMINISTIC: {
        "EXPRESSION_FAILED",
        "TOOL_FAILED_PERMANENT",
        "SCHEMA_VALIDATION",
        "NO_OUTGOING_EDGE",
        "LOOP_EXHAUSTED",
        "WORKFLOW_INVALID",
        "OUTPUT_TOO_LARGE",
        "ATTACHMENTS_UNDELIVERABLE",
        "ATTACHMENT_PATH_UNAVAILABLE",
        "SANDBOX_IMAGE_INVALID",
        "SANDBOX_START_FAILED",
        "LAUNCH_FAILED",
    },
}
SPEC_STATUS = {
    FailureClass.TRANSIENT_NODE: RunStatus.FAILED_RESUMABLE,
    FailureClass.TRANSIENT_INFRA: RunStatus.FAILED_RESUMABLE,
    FailureClass.OPERATOR_RESUMABLE: RunStatus.FAILED_RESUMABLE,
    FailureClass.BUDGET: RunStatus.PAUSED_OPERATOR,
    FailureClass.DETERMINISTIC: RunStatus.FAILED,
}


def test_every_failure_code_has_exactly_one_row() -> None:
    assert set(RULES) == set(FailureCode)
    for code in FailureCode:
        assert RULES[code].code == code
    spec_codes = [c for codes in SPEC_TABLE.values() for c in codes]
    assert len(spec_codes) == len(set(spec_codes)), "a code in two classes of the spec table"
    assert {c.value for c in FailureCode} == set(spec_codes)
    for klass, codes in SPEC_TABLE.items():
        for name in codes:
            rule = RULES[FailureCode(name)]
            assert rule.klass is klass, name
            assert rule.status is SPEC_STATUS[klass], name


def test_deterministic_code_is_classified_non_retryable() -> None:
    for code in SPEC_TABLE[FailureClass.DETERMINISTIC]:
        rule = rule_for(code)
        assert rule.klass is FailureClass.DETERMINISTIC
        assert rule.status is RunStatus.FAILED
        assert rule.node_retries == 0
        assert not is_auto_resumable(code)
        assert node_retries_for(code, declared=5) == 0
        with pytest.raises(ValueError):
            nak_delay(code, 1)


def test_bot_code_is_never_auto_resumed() -> None:
    resumable = rule_for("BUDGET_GUARD", bot_resumable=True)
    assert resumable.klass is FailureClass.OPERATOR_RESUMABLE
    assert resumable.status is RunStatus.FAILED_RESUMABLE
    terminal = rule_for("BUDGET_GUARD", bot_resumable=False)
    assert terminal.klass is FailureClass.DETERMINISTIC
    assert terminal.status is RunStatus.FAILED
    assert rule_for("BUDGET_GUARD").status is RunStatus.FAILED
    assert not is_auto_resumable("BUDGET_GUARD")
    with pytest.raises(ValueError):
        nak_delay("BUDGET_GUARD", 1)


def test_only_the_transient_classes_are_auto_resumable() -> None:
    for code in FailureCode:
        expected = RULES[code].klass in (FailureClass.TRANSIENT_NODE, FailureClass.TRANSIENT_INFRA)
        assert is_auto_resumable(code) is expected, code
    assert not is_auto_resumable(None)
    assert not is_auto_resumable(FailureCode.DLQ_PARKED)
    assert not is_auto_resumable(FailureCode.BUDGET_EXCEEDED)


def test_transient_node_codes_get_two_in_process_retries_and_infra_codes_none() -> None:
    for code in SPEC_TABLE[FailureClass.TRANSIENT_NODE]:
        assert rule_for(code).node_retries == 2
        assert node_retries_for(code) == 2
        assert node_retries_for(code, declared=0) == 0
        assert node_retries_for(code, declared=5) == 5
    for code in SPEC_TABLE[FailureClass.TRANSIENT_INFRA]:
        assert rule_for(code).node_retries == 0
        assert node_retries_for(code, declared=5) == 0


def test_node_retry_backoff_doubles_from_one_second() -> None:
    assert [node_retry_backoff(i) for i in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert node_retry_backoff(3, base_s=0.5) == 2.0
    assert node_retry_backoff(1000) == 60.0
    with pytest.raises(ValueError):
        node_retry_backoff(0)


@pytest.mark.parametrize(
    ("delivery", "expected"),
    [(1, 5.0), (2, 10.0), (3, 20.0), (4, 40.0), (7, 320.0), (8, 600.0), (10, 600.0), (500, 600.0)],
)
def test_nak_delay_ladder_doubles_from_base_and_caps_at_ten_minutes(
    delivery: int, expected: float
) -> None:
    assert nak_delay(FailureCode.TIMEOUT, delivery) == expected
    assert nak_delay(FailureCode.RUNNER_LOST, delivery) == expected


def test_nak_delay_ladder_honours_base_and_cap() -> None:
    assert nak_delay("RATE_LIMITED", 3, base_s=1.0, cap_s=3.0) == 3.0
    assert nak_delay("RATE_LIMITED", 2, base_s=1.0) == 2.0
    with pytest.raises(ValueError):
        nak_delay("RATE_LIMITED", 0)


@pytest.mark.parametrize(
    ("code", "delay"),
    [
        (FailureCode.SANDBOX_SETUP_TIMEOUT, 120.0),
        (FailureCode.SANDBOX_CAPACITY, 300.0),
        (FailureCode.ATTACHMENTS_UNFETCHABLE, 120.0),
    ],
)
def test_fixed_delays_ignore_the_ladder(code: FailureCode, delay: float) -> None:
    assert [nak_delay(code, d) for d in (1, 2, 9)] == [delay, delay, delay]


def test_non_transient_codes_have_no_nak_delay() -> None:
    for code in (FailureCode.DLQ_PARKED, FailureCode.BUDGET_EXCEEDED, FailureCode.LAUNCH_FAILED):
        with pytest.raises(ValueError):
            nak_delay(code, 1)


def test_call_errors_carry_their_codes() -> None:
    transient = Transient("RATE_LIMITED", "429 from the vendor")
    assert transient.code is FailureCode.RATE_LIMITED
    assert str(transient) == "429 from the vendor"
    assert Transient().code is FailureCode.EXECUTION_FAILED
    assert Permanent("INVALID_TICKET").code == "INVALID_TICKET"
    assert Permanent().code is FailureCode.TOOL_FAILED_PERMANENT
    assert AmbiguousEffect("timed out after send").code is FailureCode.AMBIGUOUS_EFFECT
    assert not rule_for(AmbiguousEffect().code).transient
