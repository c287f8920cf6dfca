"""Names `runner.operations` exports, imported when first used (`lazy_loader`, ADR-0024).

The runtime reads this stub for the map from name to module; type checkers read it as the
package's interface."""

from .dlq import (
    list_records,
    parked_record_id,
    purge_records,
    record_owner,
    records_of,
    replay_records,
    select_records,
    show_record,
)
from .env import Env, open_env
from .errors import UNREACHABLE, is_refusal, is_unreachable, is_usage
from .fleet import collect_garbage, ensure_wire, plan_gc, sweep
from .models import (
    GcPlan,
    GcReport,
    RecordDetail,
    ReplayOutcome,
    ReplayReport,
    SweepResult,
)
from .runs import (
    TimelineEntry,
    cancel,
    event_batches,
    get_run,
    launch,
    list_runs,
    resume,
    resume_local,
    rewind,
    run_local,
    timeline_batches,
)

__all__ = [
    "UNREACHABLE",
    "Env",
    "GcPlan",
    "GcReport",
    "RecordDetail",
    "ReplayOutcome",
    "ReplayReport",
    "SweepResult",
    "TimelineEntry",
    "cancel",
    "collect_garbage",
    "ensure_wire",
    "event_batches",
    "get_run",
    "is_refusal",
    "is_unreachable",
    "is_usage",
    "launch",
    "list_records",
    "list_runs",
    "open_env",
    "parked_record_id",
    "plan_gc",
    "purge_records",
    "record_owner",
    "records_of",
    "replay_records",
    "resume",
    "resume_local",
    "rewind",
    "run_local",
    "select_records",
    "show_record",
    "sweep",
    "timeline_batches",
]
