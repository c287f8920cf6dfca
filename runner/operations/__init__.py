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

Its names are imported when first used (`__init__.pyi` lists them; ADR-0024): a CLI command
that never publishes does not pay for importing NATS and the S3 client.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
