"""Durations (`store.timeutil.parse_duration`): every form the settings and the operator
surfaces accept, and the ones they refuse with a `ValueError` naming the value."""

from __future__ import annotations

from datetime import timedelta

import pytest

from store.timeutil import MAX_DURATION, parse_duration, utcnow


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("250ms", timedelta(milliseconds=250)),
        ("1d", timedelta(days=1)),
        (1.5, timedelta(seconds=1.5)),
        ("36525d", timedelta(days=36525)),
        (timedelta(days=7), timedelta(days=7)),
    ],
)
def test_parse_duration_reads_every_form_up_to_100_years(
    given: object, expected: timedelta
) -> None:
    assert parse_duration(given) == expected


@pytest.mark.parametrize(
    "given",
    ["1e300", "999999d", "1e400", "inf", "36526d", 10**400, 1e300, timedelta(days=999_999_999)],
)
def test_a_duration_too_large_to_represent_is_a_value_error_not_an_overflow(
    given: object,
) -> None:
    """`now - duration` must stay a datetime wherever it is computed: past 100 years (or past
    what a float or a timedelta holds) is refused as a `ValueError`, which every caller turns
    into its usage error or typed 400, never an `OverflowError`."""
    with pytest.raises(ValueError, match="longer than 100 years"):
        parse_duration(given)
    assert utcnow() - MAX_DURATION < utcnow()  # the longest accepted one still subtracts


@pytest.mark.parametrize("given", ["nan", "-1", "soon", "xs", True])
def test_a_duration_that_is_not_a_non_negative_number_is_a_value_error(given: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(given)


def test_json_timestamps_carry_six_fraction_digits_so_the_strings_sort_as_the_instants() -> None:
    from pydantic import BaseModel

    from store.timeutil import UtcDatetime, from_ms, iso_z

    class At(BaseModel):
        at: UtcDatetime

    whole, later = from_ms(1_764_950_400_000), from_ms(1_764_950_400_189)
    texts = [At(at=t).model_dump(mode="json")["at"] for t in (whole, later)]
    assert texts == ["2025-12-05T16:00:00.000000Z", "2025-12-05T16:00:00.189000Z"]
    assert sorted(texts) == texts  # `…:00Z` sorted after `…:00.189000Z` before
    assert At(at=whole).model_dump_json() == '{"at":"2025-12-05T16:00:00.000000Z"}'
    assert iso_z(whole) == texts[0]
    assert At.model_validate_json(At(at=whole).model_dump_json()).at == whole
