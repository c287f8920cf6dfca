"""The operator operations (SPEC §10, §10b, §10c; STYLE.md "where new code lives"): one set of
functions for every action and listing an operator has, called by the CLI today and by the
console and the HTTP API tomorrow, so none of them re-implements resume, cancel, replay or purge.

Each operation takes an open `Env` and parsed arguments; it returns a typed value and raises only
`RunfleetError`s — typed refusals with `code` and `remedy`, or unreachable infrastructure
(`errors.is_unreachable`); NATS's own errors are translated where the connection is opened.
Printing, prompting and flag parsing belong to the caller.

    runs   launch, run_local, get_run, list_runs, event_batches, timeline_batches, resume,
           resume_local, cancel, rewind
    dlq    list_records, select_records, show_record, replay_records, purge_records,
           parked_record_id, record_owner, records_of
    fleet  ensure_wire, sweep, plan_gc, collect_garbage
"""

from runner.operations.dlq import (
    list_records,
    parked_record_id,
    purge_records,
    record_owner,
    records_of,
    replay_records,
    select_records,
    show_record,
)
from runner.operations.env import Env, open_env
from runner.operations.errors import UNREACHABLE, is_refusal, is_unreachable, is_usage
from runner.operations.fleet import collect_garbage, ensure_wire, plan_gc, sweep
from runner.operations.models import (
    GcPlan,
    GcReport,
    RecordDetail,
    ReplayOutcome,
    ReplayReport,
    SweepResult,
)
from runner.operations.runs import (
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
