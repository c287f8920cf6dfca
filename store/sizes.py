"""Sizes as people write them (SPEC §12): `256MiB`, `1GB`, `512 KiB` or plain bytes, the way
durations accept `30s`, `5m` or plain seconds (`store.timeutil.Duration`).

Decimal units are powers of 1000 (`KB`, `MB`, `GB`, `TB`), binary ones powers of 1024 (`KiB`,
`MiB`, `GiB`, `TiB`); case does not matter, so `1gb` is `1GB`. A fraction is allowed where it
comes to whole bytes' worth (`1.5GiB`); the result is rounded down to a byte.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)\s*$")
SIZE_FORM = "a size such as 256MiB, 1GB or plain bytes"


def parse_size(value: Any) -> int:
    """Bytes from `256MiB`, `1GB`, `512 KiB`, `1048576` (int or numeric text)."""
    if isinstance(value, bool):
        raise ValueError("a size, not a bool")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value).lower())
        if match is None or match["unit"] not in _UNITS:
            raise ValueError(f"{value!r} is not a size (use e.g. 256MiB, 1GB or plain bytes)")
        number, unit = float(match["number"]), match["unit"]
    if number < 0:
        raise ValueError(f"size {value!r} is negative")
    return int(number * _UNITS[unit])


def format_size(size: int) -> str:
    """The shortest exact binary spelling (`268435456` → `256MiB`), else plain bytes."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


Size = Annotated[int, BeforeValidator(parse_size)]
"""A non-negative number of bytes from `256MiB`, `1GB` or plain bytes."""
