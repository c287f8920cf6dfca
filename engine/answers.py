"""Answers to a human node's questions, coerced against its schema (SPEC §6.4).

Two sources with two rules. Strings from `--answer k=v` (`from_cli=True`) are parsed to the
question's type. Typed JSON (`--answers-file`, the queue) is checked strictly: a JSON `"yes"` is
not a bool and `1` is not a string; an int is a fine `number`. Either way, an answer naming no
question, a missing required answer, and a value of the wrong type are refused with
`AnswersInvalid` naming the field and the expected type; no answers at all while some are
required is `AnswersRequired`.

The result has every question's name: an optional question left unanswered is `None`, so a
`when` can test `answers.note` without tripping over a missing field.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.errors import AnswersInvalid, AnswersRequired
from engine.workflow import Question, value_fits
from store.blobkeys import validate_segment
from store.errors import BlobKeyInvalid

_TRUE = frozenset({"true", "yes", "1"})
_FALSE = frozenset({"false", "no", "0"})
_INT = re.compile(r"[+-]?\d+")
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_EXPECTED = {
    "string": "a string",
    "bool": "a bool (true/false/yes/no/1/0)",
    "int": "an int",
    "number": "a number",
    "file": "a file (@path)",
}
_EXPECTED_JSON = {
    **_EXPECTED,
    "string": "a JSON string",
    "bool": "a JSON true or false",
    "int": "a JSON integer",
    "number": "a JSON number",
}
"""What typed JSON must hold: `"yes"` and `1` are a `--answer`'s forms, not a JSON bool's (found
by a new-user walkthrough: the API's refusal offered the forms it refuses)."""


def coerce_answers(
    questions: Sequence[Question],
    raw: Mapping[str, Any],
    *,
    from_cli: bool,
    base_dir: Path | None,
    answered_elsewhere: bool = False,
) -> dict[str, Any]:
    """Validate `raw` against `questions`; return the typed answers, one per question.

    `answered_elsewhere`: the person did answer, in answers judged apart (`--answer` strings
    that did not parse), so an empty `raw` is not "no answers at all" (`AnswersRequired`).

    `base_dir` anchors relative `@path`s (the operator's working directory); `None` means the
    process's current directory. A `file` answer becomes `{"path", "bytes", "sha256"}` of a
    file that exists when the answer is given.
    """
    by_name = {q.name: q for q in questions}
    missing = [q.name for q in questions if q.required and q.name not in raw]
    if missing and not raw and not answered_elsewhere:
        raise AnswersRequired(missing)
    expected = ", ".join(by_name) or "none"
    wrong = [
        AnswersInvalid(name, f"no such question (questions: {expected})")
        for name in raw
        if name not in by_name
    ]
    wrong += [AnswersInvalid(m, f"is required ({_EXPECTED[by_name[m].type]})") for m in missing]
    out: dict[str, Any] = {}
    for q in questions:
        if q.name not in raw or (raw[q.name] is None and not q.required):
            out[q.name] = None
            continue
        try:
            out[q.name] = _coerce(q, raw[q.name], from_cli=from_cli, base_dir=base_dir)
        except AnswersInvalid as exc:
            wrong.append(exc)
    if wrong:
        raise AnswersInvalid.every(wrong)
    return out


def _coerce(q: Question, value: Any, *, from_cli: bool, base_dir: Path | None) -> Any:
    if q.type == "file":
        return _file(q, value, base_dir)
    if from_cli:
        if not isinstance(value, str):
            raise _wrong(q, value)
        return _parse(q, value)
    if not value_fits(q.type, value):
        raise _wrong(q, value, typed=True)
    return value


def _parse(q: Question, text: str) -> Any:
    stripped = text.strip()
    if q.type == "string":
        return text
    if q.type == "bool":
        lowered = stripped.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    elif q.type == "int":
        if _INT.fullmatch(stripped):
            return _int(q, stripped)
    elif q.type == "number":
        if _INT.fullmatch(stripped):
            number = _int(q, stripped)
            if value_fits("number", number):
                return number
        elif _NUMBER.fullmatch(stripped) and math.isfinite(float(stripped)):
            return float(stripped)
    raise _wrong(q, text)


def _int(q: Question, digits: str) -> int:
    try:
        return int(digits)
    except ValueError:  # past Python's int/str conversion limit (4300 digits)
        raise AnswersInvalid(
            q.name, f"expected {_EXPECTED[q.type]}, got {len(digits)} digits (too long)"
        ) from None


def _file(q: Question, value: Any, base_dir: Path | None) -> dict[str, Any]:
    if isinstance(value, Mapping) and "upload" in value:
        return _uploaded(q, value)
    if isinstance(value, Mapping) and isinstance(value.get("path"), str):
        value = value["path"]
    if not isinstance(value, str) or not value.strip():
        raise _wrong(q, value)
    text = value.strip()
    path = Path(text[1:] if text.startswith("@") else text).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise AnswersInvalid(q.name, f"expected {_EXPECTED['file']}: no file at {path}")
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise AnswersInvalid(q.name, f"cannot read {path}: {exc.strerror or exc}") from exc
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest()}


def _uploaded(q: Question, value: Mapping[str, Any]) -> dict[str, Any]:
    """A `file` answer sent through the queue (SPEC §6.4, §8): a staged upload's id and what
    was staged. No path is opened: the fresh claim promotes the upload to the run."""
    upload, filename = value.get("upload"), value.get("filename")
    size, digest = value.get("bytes"), value.get("sha256")
    if not (
        isinstance(upload, str)
        and _UPLOAD_ID.fullmatch(upload)
        and isinstance(filename, str)
        and filename
        and isinstance(size, int)
        and not isinstance(size, bool)
        and isinstance(digest, str)
        and _SHA256.fullmatch(digest)
    ):
        raise AnswersInvalid(
            q.name, f"expected an upload {{upload, filename, bytes, sha256}}, got {dict(value)!r}"
        )
    try:
        # The file lands as `<attachments>/<field>/<filename>` on the runner: one path
        # segment, never `..` or `/` (found by review: `../../x` wrote outside the directory).
        validate_segment(filename, what="file name")
    except BlobKeyInvalid as exc:
        raise AnswersInvalid(q.name, exc.message) from exc
    return {"upload": upload, "filename": filename, "bytes": size, "sha256": digest}


def _wrong(q: Question, value: Any, *, typed: bool = False) -> AnswersInvalid:
    try:
        shown = repr(value)
    except ValueError:  # an int too long to print
        shown = "(too long to show)"
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return AnswersInvalid(
        q.name,
        f"expected {(_EXPECTED_JSON if typed else _EXPECTED)[q.type]}, got"
        f" {type(value).__name__} {shown}",
    )
