"""Answers coerced against a human node's questions (SPEC §6.4)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from engine.answers import coerce_answers
from engine.errors import AnswersInvalid, AnswersRequired
from engine.workflow import Question

QUESTIONS = [
    Question(name="approved", type="bool"),
    Question(name="count", type="int", required=False),
    Question(name="ratio", type="number", required=False),
    Question(name="note", type="string", required=False),
]


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("approved", "true", True),
        ("approved", "YES", True),
        ("approved", "1", True),
        ("approved", "false", False),
        ("approved", "no", False),
        ("approved", "0", False),
        ("count", "42", 42),
        ("count", "-3", -3),
        ("ratio", "0.5", 0.5),
        ("ratio", "2", 2),
        ("ratio", "1e3", 1000.0),
        ("note", "ship it; now", "ship it; now"),
        ("note", "", ""),
    ],
)
def test_cli_strings_are_coerced_to_the_question_type(name: str, text: str, expected: Any) -> None:
    raw = {"approved": "yes", name: text}
    answers = coerce_answers(QUESTIONS, raw, from_cli=True, base_dir=None)
    assert answers[name] == expected
    assert type(answers[name]) is type(expected)


@pytest.mark.parametrize(
    ("name", "text", "expected_type"),
    [
        ("approved", "maybe", "a bool"),
        ("count", "4.5", "an int"),
        ("count", "1_000", "an int"),
        ("ratio", "nan", "a number"),
        ("ratio", "inf", "a number"),
        ("ratio", "one", "a number"),
    ],
)
def test_bad_cli_strings_are_refused(name: str, text: str, expected_type: str) -> None:
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(QUESTIONS, {"approved": "yes", name: text}, from_cli=True, base_dir=None)
    assert info.value.field == name
    assert expected_type in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "expected_type"),
    [
        # Typed JSON names JSON's forms: a `--answer`'s `yes` and `1` are refused here, and a
        # message offering them left an API caller no way to tell what to send.
        ("approved", "yes", "a JSON true or false, got str"),  # a JSON string is not a bool
        ("approved", 1, "a JSON true or false, got int"),
        ("count", True, "a JSON integer"),
        ("count", 2.0, "a JSON integer"),
        ("count", "2", "a JSON integer"),
        ("ratio", "0.5", "a JSON number"),
        ("ratio", False, "a JSON number"),
        ("note", 5, "a JSON string"),
    ],
)
def test_answers_of_the_wrong_type_are_refused_with_the_field_named(
    name: str, value: Any, expected_type: str
) -> None:
    raw = {"approved": True, name: value}
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(QUESTIONS, raw, from_cli=False, base_dir=None)
    assert info.value.field == name
    assert info.value.code == "answers_invalid"
    assert repr(name) in str(info.value)
    assert f"expected {expected_type}" in str(info.value)


def test_typed_json_values_pass_and_int_is_a_number() -> None:
    raw = {"approved": False, "count": 3, "ratio": 2, "note": "x"}
    out = coerce_answers(QUESTIONS, raw, from_cli=False, base_dir=None)
    assert out == raw


def test_unanswered_optional_questions_are_none() -> None:
    out = coerce_answers(QUESTIONS, {"approved": True}, from_cli=False, base_dir=None)
    assert out == {"approved": True, "count": None, "ratio": None, "note": None}


def test_unknown_answer_names_are_refused() -> None:
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(
            QUESTIONS, {"approved": True, "aproved": True}, from_cli=False, base_dir=None
        )
    assert info.value.field == "aproved"


def test_missing_required_answer_is_refused() -> None:
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(QUESTIONS, {"note": "x"}, from_cli=False, base_dir=None)
    assert info.value.field == "approved"
    assert "required" in str(info.value)


def test_no_answers_at_all_is_answers_required() -> None:
    with pytest.raises(AnswersRequired) as info:
        coerce_answers(QUESTIONS, {}, from_cli=True, base_dir=None)
    assert info.value.code == "answers_required"
    assert info.value.missing == ("approved",)


def test_file_answer_by_at_path(tmp_path: Path) -> None:
    (tmp_path / "report.txt").write_bytes(b"hello\n")
    questions = [Question(name="report", type="file")]
    out = coerce_answers(questions, {"report": "@report.txt"}, from_cli=True, base_dir=tmp_path)
    assert out["report"] == {
        "path": str((tmp_path / "report.txt").resolve()),
        "bytes": 6,
        "sha256": hashlib.sha256(b"hello\n").hexdigest(),
    }
    # typed JSON may name the file too, with or without `@`
    again = coerce_answers(questions, {"report": "report.txt"}, from_cli=False, base_dir=tmp_path)
    assert again == out


def test_file_answer_must_exist(tmp_path: Path) -> None:
    questions = [Question(name="report", type="file")]
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(questions, {"report": "@nope.txt"}, from_cli=True, base_dir=tmp_path)
    assert info.value.field == "report"
    assert "no file" in str(info.value)
    with pytest.raises(AnswersInvalid):
        coerce_answers(questions, {"report": "@"}, from_cli=True, base_dir=tmp_path)
    with pytest.raises(AnswersInvalid):
        coerce_answers(questions, {"report": 7}, from_cli=False, base_dir=tmp_path)


@pytest.mark.parametrize(
    "filename", ["../../escaped.txt", "..", ".", "a/b.txt", "/etc/passwd", "a\\b.txt", "x\x00y"]
)
def test_an_uploaded_file_answer_whose_filename_is_not_one_path_segment_is_refused(
    filename: str,
) -> None:
    """Found by review: the file lands as `<attachments>/<field>/<filename>` on the runner
    host, and `../../x` wrote outside the directory."""
    questions = [Question(name="doc", type="file")]
    answer = {"upload": "a" * 32, "filename": filename, "bytes": 3, "sha256": "0" * 64}
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(questions, {"doc": answer}, from_cli=False, base_dir=None)
    assert info.value.field == "doc"
    assert "one non-empty path segment" in str(info.value)


def test_an_uploaded_file_answer_with_a_plain_filename_is_kept() -> None:
    questions = [Question(name="doc", type="file")]
    answer = {"upload": "a" * 32, "filename": "report v2.txt", "bytes": 3, "sha256": "0" * 64}
    assert coerce_answers(questions, {"doc": answer}, from_cli=False, base_dir=None) == {
        "doc": answer
    }


def test_a_json_number_answer_past_the_float_range_is_refused_naming_the_field() -> None:
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(
            QUESTIONS, {"approved": True, "ratio": 10**400}, from_cli=False, base_dir=None
        )
    assert info.value.field == "ratio"
    assert "a JSON number" in str(info.value)


@pytest.mark.parametrize("name", ["count", "ratio"])
def test_a_cli_answer_past_the_int_digit_limit_is_refused_naming_the_field(name: str) -> None:
    # 5000 digits is past Python's int/str conversion limit: `int()` raises ValueError
    raw = {"approved": "yes", name: "9" * 5000}
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(QUESTIONS, raw, from_cli=True, base_dir=None)
    assert info.value.field == name
    assert len(str(info.value)) < 500


def test_a_cli_number_answer_past_the_float_range_is_refused_naming_the_field() -> None:
    raw = {"approved": "yes", "ratio": "1" + "0" * 400}
    with pytest.raises(AnswersInvalid) as info:
        coerce_answers(QUESTIONS, raw, from_cli=True, base_dir=None)
    assert info.value.field == "ratio"


def test_every_wrong_answer_is_named_in_one_refusal_not_only_the_first() -> None:
    with pytest.raises(AnswersInvalid) as caught:
        coerce_answers(
            QUESTIONS,
            {"count": "many", "ratio": "half", "colour": "red"},
            from_cli=True,
            base_dir=None,
        )
    exc = caught.value
    assert [name for name, _ in exc.problems] == ["colour", "approved", "count", "ratio"]
    for name in ("colour", "approved", "count", "ratio"):
        assert f"answer {name!r}" in exc.message
    assert "no such question" in exc.message and "is required" in exc.message
    assert exc.field == "colour"  # the first, for callers that name one
    assert exc.remedy == "correct the named answers and resume again"


def test_one_wrong_answer_is_refused_as_before() -> None:
    with pytest.raises(AnswersInvalid) as caught:
        coerce_answers(QUESTIONS, {"approved": "maybe"}, from_cli=True, base_dir=None)
    assert caught.value.problems == ((caught.value.field, caught.value.detail),)
    assert caught.value.message.startswith("answer 'approved': ")
    assert caught.value.remedy == "correct the named answer and resume again"
