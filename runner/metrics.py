"""Prometheus metrics of SPEC §5.8, on a registry per runner (tests run several in-process).

No `*_created` series (they double every counter and histogram for a timestamp nobody graphs),
a `runfleet_build_info{version}` gauge so a dashboard can tell which release answers, and the
process collector (CPU, memory, open files of the runner process). Label values that name a
status are real run statuses (SPEC §2), never a disposition's reason.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)

from runner.build import source_digest, version
from store import Event, EventDraft, RunStatus

M = TypeVar("M", Counter, Histogram)

disable_created_metrics()  # type: ignore[no-untyped-call]

STATUS_OF_REASON: dict[str, RunStatus] = {
    "transient": RunStatus.FAILED_RESUMABLE,
    "dlq_parked": RunStatus.FAILED_RESUMABLE,
    "handoff_superseded": RunStatus.FAILED_RESUMABLE,
    "cancelled": RunStatus.CANCELLED,
    "drain": RunStatus.QUEUED,
    "lease_lost": RunStatus.RUNNING,
    "unwind_ceiling": RunStatus.RUNNING,
    "store_unreachable": RunStatus.RUNNING,
}
"""A disposition's reason (runner/disposition.py `Plan.reason`) → the run status the execution
left written: a nak'd transient failure and a DLQ park are `failed_resumable`; a drain's handoff
is `queued` again (a superseded one stays `failed_resumable` RUNNER_INTERRUPTED); when the
execution could not write its status (lease lost, store unreachable, the unwind ceiling) the
run is still `running` as far as it knows. Other reasons are already a status (`reason_for`)."""


def status_label(reason: str) -> str:
    """The `status` label of `runfleet_execution_seconds` for a disposition's `reason`."""
    if reason in STATUS_OF_REASON:
        return str(STATUS_OF_REASON[reason])
    try:
        return str(RunStatus(reason))
    except ValueError:  # a reason added without a row here; a test enumerates them
        return str(RunStatus.RUNNING)


class RunnerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        Info("runfleet_build", "The runfleet release this process runs", registry=r).info(
            {"version": version(), "build": source_digest()}
        )
        ProcessCollector(registry=r)
        self.deliveries = Counter(
            "runfleet_deliveries",
            "Deliveries by disposition and reason",
            ["disposition", "reason"],
            registry=r,
        )
        self.claims = Counter(
            "runfleet_claims", "Claims by path and outcome", ["path", "outcome"], registry=r
        )
        self.lease_refreshes = Counter(
            "runfleet_lease_refreshes",
            "Lease refresh beats (ok), refresh tries that failed (failed), leases lost (lost)",
            ["outcome"],
            registry=r,
        )
        self.lease_refresh_latency = Histogram(
            "runfleet_lease_refresh_seconds",
            "Lease refresh latency",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10),
        )
        self.inflight = Gauge("runfleet_inflight_runs", "Executions in flight", registry=r)
        self.free_slots = Gauge("runfleet_free_slots", "Free delivery slots", registry=r)
        self.fetched = Histogram(
            "runfleet_fetch_messages",
            "Messages per pull that delivered any; mostly 1s under steady load mean"
            " RUNFLEET_FETCH_GATHER is short for the rate",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.ack_pending = Gauge(
            "runfleet_num_ack_pending",
            "Consumer num_ack_pending, read every few seconds (the consumer's, the same on"
            " every runner: graph max(), not sum())",
            registry=r,
        )
        self.num_pending = Gauge(
            "runfleet_num_pending",
            "Consumer num_pending: messages not yet delivered (the backlog an autoscaler"
            " reads; the same on every runner: graph max())",
            registry=r,
        )
        self.handoffs_taken = Counter(
            "runfleet_handoffs_taken",
            "Runs another runner handed off (a drain) claimed here: what a scale-down costs",
            registry=r,
        )
        self.queue_wait = Histogram(
            "runfleet_queue_wait_seconds",
            "Published to claimed",
            registry=r,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600),
        )
        self.run_duration = Histogram(
            "runfleet_execution_seconds",
            "Claim to disposal, by status written",
            ["status"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
        )
        self.dlq_records = Counter(
            "runfleet_dlq_records", "DLQ records written, by reason", ["reason"], registry=r
        )
        self.sweeper_actions = Counter(
            "runfleet_sweeper_actions", "Orphan sweeper actions", ["action"], registry=r
        )
        self.sweeper_passes = Counter(
            "runfleet_sweeper_passes",
            "Sweeper turns by outcome: swept (this runner held the lock and finished its pass),"
            " cut_short (the lock lapsed mid-pass), not_elected (another runner swept),"
            " skipped (the store or NATS did not answer), failed (the pass raised)",
            ["outcome"],
            registry=r,
        )
        self.sweeper_last_pass = Gauge(
            "runfleet_sweeper_last_pass_timestamp_seconds",
            "Unix time this runner last swept (0: never since it started). One runner sweeps"
            " at a time: max() over the fleet is when the fleet's sweeper last ran",
            registry=r,
        )
        self.backstop_last_poll = Gauge(
            "runfleet_backstop_last_poll_timestamp_seconds",
            "Unix time this runner's DLQ backstop last finished a pull for max-deliveries"
            " advisories (0: never since it started); a backstop stuck settling one stops it",
            registry=r,
        )
        self.scratch_bank_bytes = Counter("runfleet_scratch_bank_bytes", "Bytes banked", registry=r)
        self.scratch_bank_seconds = Histogram(
            "runfleet_scratch_bank_seconds",
            "Scratch bank duration",
            registry=r,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 240),  # the bank budget is 4 min
        )

    def on_event(self, event: Event | EventDraft) -> None:
        """An execution's event, as it is appended or once the write it rode in landed: the
        scratch bank's bytes and duration."""
        if event.type == "sandbox_scratch_banked":
            self.scratch_bank_bytes.inc(int(event.data.get("bytes") or 0))
            self.scratch_bank_seconds.observe(float(event.data.get("seconds") or 0.0))

    def delivery(self, disposition: str, reason: str) -> None:
        self.child(self.deliveries, disposition, reason).inc()

    def child(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)` (in label-name order), cached: `labels()` takes a lock and
        builds its key on every call, three times a run on the hot path (issue 19)."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found
