"""The soak's report: what a soak counted and every violation it found (`Report`), its table
as the command line prints it (and docs/reliability.md quotes it), and the product findings a
violation may name (`known_finding`). Its own module because the tests assert on it, the
command line prints it, and both name the findings.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.soak_cluster import KINDS

KNOWN_FINDINGS = {
    "F1": re.compile(r"task loop:backstop failed: ServerError\(\).* in _delete"),
    "F2": re.compile(r"task loop:backstop failed: (ServiceUnavailableError|TimeoutError)\(\)"),
    "F3": re.compile(r"task loop:sweeper failed: TimeoutError\(\)"),
    "F4": re.compile(r"is finished but has no run_finished event"),
}
"""The product findings of this soak (docs/reliability.md, "Findings"), by the cause a violation
names, all fixed in commit 36fa8db: F1 the backstop died deleting a message already gone; F2 the
backstop loop died on a NATS error while the server restarted (a 503 on its fetch, a JetStream
call timing out); F3 the sweeper loop died on a JetStream call timing out while the server was
down (each of F1-F3 ended the runner process with exit 1); F4 a runner killed between a settled
status and its event left the event missing for good. A violation that matches one is that
finding come back."""


def known_finding(violation: str) -> str | None:
    return next((name for name, sig in KNOWN_FINDINGS.items() if sig.search(violation)), None)


@dataclass
class Report:
    config: dict[str, Any]
    runs: int = 0
    finished: int = 0
    launch_refused: int = 0
    kills: int = 0
    restarts: int = 0
    crashes: int = 0
    nats_restarts: int = 0
    leader_kills: int = 0
    max_leaderless_s: float = 0.0
    """The longest a server fault left the runs stream or its consumer with no live leader:
    the longest a run waited for a live broker (no publish, ack or delivery could land)."""
    server_faults: Counter[str] = field(default_factory=Counter)
    """Cluster faults by kind (`tests.soak_cluster.KINDS`), stream-leader kills included."""
    dedupe_answered: int = 0
    """Publications answered `duplicate` by the stream's dedupe window (every process's log)."""
    redeliveries: int = 0
    """Deliveries beyond a message's first (the delivery log; a lower bound, fire-and-forget)."""
    store_fault_windows: int = 0
    post_engine_windows: int = 0
    post_engine_refused: int = 0
    """Caught `finished` status writes the store refused (`status not written`, then a nak)."""
    status_refused: int = 0
    """Every status write the store refused, caught or not."""
    drains: int = 0
    handoffs: int = 0
    drain_held: list[tuple[bool, int]] = field(default_factory=list)
    """Per drain: (during the NATS outage, runs it held mid-`work` at SIGTERM)."""
    orphans_repaired: int = 0
    stale_leases: int = 0
    missing_events: int = 0
    max_orphan_s: float = 0.0
    rerun_nodes: int = 0
    rerun_causes: Counter[str] = field(default_factory=Counter)
    transient_retries: int = 0
    resumes: int = 0
    resumes_cli: int = 0
    resume_retries: int = 0
    replays: int = 0
    """Runs parked by a spent delivery budget and replayed from the DLQ (the operator's move)."""
    interrupted: bool = False
    lost: int = 0
    duplicated: int = 0
    stuck: int = 0
    dlq_records: int = 0
    poison: int = 0
    hostile: int = 0
    dlq_chaos: int = 0
    """Records of runs parked by a spent delivery budget (and replayed), seen while they stood."""
    dlq_withdrawn: int = 0
    """Records seen, then gone without a replay: a last delivery's park that did not land."""
    wall_s: float = 0.0
    data_dir: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(self.rerun_causes.items())) or "-"
        rows = [
            ("runs", str(self.runs)),
            ("finished", str(self.finished)),
            ("launch refused (caller told)", str(self.launch_refused)),
            ("runner SIGKILLs", str(self.kills)),
            ("runner restarts", str(self.restarts)),
            ("runner crashes (unexpected exits)", str(self.crashes)),
            ("nats restarts", str(self.nats_restarts)),
            (
                "nats server faults (cluster; " + "/".join(KINDS) + ")",
                f"{sum(self.server_faults.values())} ("
                + "/".join(str(self.server_faults[k]) for k in KINDS)
                + ")",
            ),
            ("nats stream-leader SIGKILLs (cluster)", str(self.leader_kills)),
            (
                "longest a run waited for a live broker (no leader)",
                f"{self.max_leaderless_s:.1f}s",
            ),
            ("duplicate publications answered by dedupe", str(self.dedupe_answered)),
            ("redeliveries (delivery log)", str(self.redeliveries)),
            ("store-fault windows", str(self.store_fault_windows)),
            (
                "post-engine store faults (status writes refused)",
                f"{self.post_engine_windows} ({self.post_engine_refused})",
            ),
            ("status writes refused by the store (all)", str(self.status_refused)),
            ("drains (SIGTERM)", str(self.drains)),
            ("handoffs published", str(self.handoffs)),
            ("orphans repaired (max age)", f"{self.orphans_repaired} ({self.max_orphan_s:.1f}s)"),
            ("expired leases left on settled runs", str(self.stale_leases)),
            ("finished runs missing `run_finished`", str(self.missing_events)),
            ("transient first-try failures", str(self.transient_retries)),
            (
                "resumes (via CLI) / retried",
                f"{self.resumes} ({self.resumes_cli}) / {self.resume_retries}",
            ),
            ("re-run nodes (at-least-once)", f"{self.rerun_nodes} ({causes})"),
            ("budget-spent runs replayed from the DLQ", str(self.replays)),
            ("lost", str(self.lost)),
            ("duplicated", str(self.duplicated)),
            ("stuck", str(self.stuck)),
            (
                "DLQ records (deliberate poison, of it hostile)",
                f"{self.dlq_records} ({self.poison}, {self.hostile})",
            ),
            (
                "chaos DLQ records seen: replayed / withdrawn",
                f"{self.dlq_chaos} / {self.dlq_withdrawn}",
            ),
            ("wall time", f"{self.wall_s:.1f}s"),
            ("violations", str(len(self.violations))),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)
