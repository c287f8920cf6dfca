"""Prometheus metrics of SPEC §5.8, on a registry per runner (tests run several in-process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RunnerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
            "runfleet_lease_refreshes", "Lease refresh beats", ["outcome"], registry=r
        )
        self.lease_refresh_latency = Histogram(
            "runfleet_lease_refresh_seconds",
            "Lease refresh latency",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.inflight = Gauge("runfleet_inflight_runs", "Executions in flight", registry=r)
        self.free_slots = Gauge("runfleet_free_slots", "Free delivery slots", registry=r)
        self.ack_pending = Gauge(
            "runfleet_num_ack_pending", "Consumer num_ack_pending (last read)", registry=r
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
            buckets=(0.01, 0.1, 1, 10, 60, 600, 3600),
        )
        self.dlq_records = Counter(
            "runfleet_dlq_records", "DLQ records written, by reason", ["reason"], registry=r
        )
        self.sweeper_actions = Counter(
            "runfleet_sweeper_actions", "Orphan sweeper actions", ["action"], registry=r
        )
        self.scratch_bank_bytes = Counter("runfleet_scratch_bank_bytes", "Bytes banked", registry=r)
        self.scratch_bank_seconds = Histogram(
            "runfleet_scratch_bank_seconds", "Scratch bank duration", registry=r
        )

    def delivery(self, disposition: str, reason: str) -> None:
        self.deliveries.labels(disposition=disposition, reason=reason).inc()
