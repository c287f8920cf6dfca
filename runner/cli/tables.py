"""Tables for people: `runfleet runs` (newest first, SPEC §10 v2.2)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from engine.failures import FailureCode
from store import RunDocument, RunStatus

MOVING = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
SHOWN_MAX = 400
"""Characters of one untrusted value printed on a line (a 60 KB header stays one screen)."""


def shown(text: str, limit: int = SHOWN_MAX) -> str:
    """`text` safe for a terminal: control characters (ESC, CR, LF, …) as Python escapes, and
    cut at `limit` with what was left out said. Values that came off the wire (a dead message's
    headers, run id, detail) reach `dlq list`/`show`; printed raw, `\x1b[2J…` would clear the
    operator's screen and draw whatever the sender chose (an on-call walkthrough's finding)."""
    cut = text[:limit]
    safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return safe + (f" … ({len(text) - limit} more characters)" if len(text) > limit else "")


def duration_text(value: timedelta) -> str:
    """`0.4s`, `12s`, `3m05s`, `2h10m`, `3d04h`: short, and exact enough to compare runs."""
    seconds = max(value.total_seconds(), 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def run_duration(run: RunDocument, now: datetime) -> timedelta:
    """Wall time since the run was created: to its last write once it stopped moving, to now
    while it is queued or running."""
    end = now if run.status in MOVING else run.updated_at
    return end - run.created_at


CODE_WIDTH = max(len(code) for code in FailureCode)
"""Every failure code whole: a code cut to 18 characters (`TOOL_FAILED_TRANSI`) was pasted
into `runs --code` and matched nothing (found by a newcomer's walkthrough)."""


def runs_table(runs: Sequence[RunDocument], now: datetime) -> list[str]:
    header = (
        f"{'RUN':<36}  {'WORKFLOW':<16}  {'STATUS':<20}  {'CODE':<{CODE_WIDTH}}  {'ORIGIN':<6}"
        f"  {'STARTED (UTC)':<19}  {'DURATION':>8}  ATTEMPT"
    )
    lines = [header]
    for r in runs:
        started = r.created_at.strftime("%Y-%m-%d %H:%M:%S")
        lines.append(
            f"{shown(r.run_id):<36}  {shown(r.workflow.name[:16]):<16}  {r.status:<20}"
            f"  {r.failure_code or '':<{CODE_WIDTH}}  {r.origin:<6}  {started:<19}"
            f"  {duration_text(run_duration(r, now)):>8}  {r.attempt}"
        )
    return lines
