"""The runner's `/metrics` (SPEC §5.8; issue 17 item 8): no `*_created` series, a
`runfleet_build_info{version}`, the process collector, and only real run statuses (SPEC §2) as
`status` label values — a disposition's reason (`transient`, `dlq_parked`, `drain`) is mapped to
the status the execution left written."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runner.build import source_digest
from runner.metrics import RunnerMetrics, status_label
from store import RunStatus

ROOT = Path(__file__).resolve().parents[2]
STATUSES = {s.value for s in RunStatus}


def exposition(metrics: RunnerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_metrics_have_no_created_series() -> None:
    m = RunnerMetrics()
    m.delivery("ack", "finished")
    m.run_duration.labels(status="finished").observe(1.0)
    m.queue_wait.observe(0.1)
    text = exposition(m)
    assert "runfleet_deliveries_total" in text
    assert "_created" not in text, [ln for ln in text.splitlines() if "_created" in ln]


def test_metrics_carry_build_info_with_the_version_and_the_process_collector() -> None:
    text = exposition(RunnerMetrics())
    version = metadata.version("runfleet")
    assert f'runfleet_build_info{{build="{source_digest()}",version="{version}"}} 1.0' in text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"process_cpu_seconds", "process_resident_memory_bytes"} <= names


def disposition_reasons() -> set[str]:
    """Every `Plan(..., reason=...)` literal the disposition can return."""
    source = (ROOT / "runner" / "disposition.py").read_text()
    return set(re.findall(r'Plan\([^)]*reason="([a-z_]+)"', source, flags=re.S))


def test_every_disposition_reason_labels_a_real_status() -> None:
    reasons = disposition_reasons()
    assert {"transient", "dlq_parked", "drain", "cancelled", "lease_lost"} <= reasons
    for reason in reasons:
        assert status_label(reason) in STATUSES, reason
    assert status_label("transient") == "failed_resumable"
    assert status_label("drain") == "queued"
    for status in STATUSES:  # `reason_for(doc)`: a status written passes as itself
        assert status_label(status) == status
