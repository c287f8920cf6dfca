"""The chaos soak: many runs through a real fleet while it is being broken on purpose.

`python -m tests.soak` runs it (`__main__.py`; `--help` lists the options; every fault is on by
default); the tests run it at CI size through `run_soak`.

It starts its own `nats-server` (`runner.localnats.NatsServer`) in a temporary directory, a SQLite
store, filesystem blobs and the streams, with short leases (TTL 3 s) and a fast sweeper (1 s
interval, 3 s grace), then N `runfleet runner` processes. It launches K runs of one workflow:

    prepare (tool) -> flaky (tool, exits 75 on its first try per run) -> approve (human)
        -> work (tool, sleeps 1-3 s) -> finish (tool, writes the completion ledger)

Every tool node appends one line per execution to a ledger (time, run id, node, execution
token — the lease token, mapped to its attempt through the `run_claimed` events). While the runs
flow, the soak answers the human pauses (the publisher's resume, every 10th through `runfleet
resume`), and breaks things:

- SIGKILL: a random runner every `--kill-every` s (jittered), restarted at once. Saved by the
  lease's expiry, the redelivery after `ack_wait`, and the adoption (SPEC §5.3, §5.4).
- drain: SIGTERM to the runner holding most runs mid-`work`, NATS up. Saved by the handoff
  (§5.6): `RUNNER_INTERRUPTED`, attempt + 1, a fresh publication; the runner exits 0.
- NATS outage: `nats-server` stopped and started again on the same port; while it is down a
  runner holding runs is SIGTERMed, so its handoff publishes fail. Saved by the orphan sweeper
  (§5.9), which republishes the handed-off attempts.
- (`--nats-cluster 3`) a three-node JetStream cluster (`runner.localcluster`) with every stream
  at three replicas, `--leader-kills` SIGKILLs of the node leading the runs stream, each
  restarted after `--leader-outage-s`, and `--server-faults` more in turn (`tests/soak_cluster.py`:
  SIGKILL of a random node, of the consumer's leader, stream and consumer leader step-downs
  through the JetStream API, the consumer's leader SIGSTOPped past `ack_wait`). Saved by the
  client's reconnect to another server, the new leader (and the stream's dedupe window), and the
  consumer's replicated state.
- store fault: a separate sqlite3 connection holds `BEGIN EXCLUSIVE` longer than the busy
  timeout, so every write of every process gets SQLITE_BUSY (`StoreUnavailable`); reads go on
  (WAL). Saved by the transient nak, lease loss and fencing (§5.1, §5.4, §5.6).
- post-engine store fault: the same lock, taken at the instant a run's last node is done and
  its `finished` status write goes (timed by the one seam in the runner processes,
  `tests/soak_seam.py`), held past two busy timeouts, so the store refuses that status write.
  Saved by the nak with no DLQ record, teardown and release still attempted, and the adoption
  that finds the last checkpoint written (§5.1, §5.6 v2.2; ADR-0010).
- poison: garbage on the work subject (bytes, wrong JSON, lost runs, another tenant's message
  for a real run) and hostile bodies (`tests/soak_hostile.py`: 5 000-digit integers, 200 000
  nested arrays, a 1 MB string, wrong types at each field, a lying 5 000-digit attempt header).
  Saved by admission's DLQ path (§5.2 steps 1-2): each one a `malformed` record.

Acting as the operator, it also replays from the DLQ a run parked `DLQ_PARKED` because chaos
spent its whole delivery budget (10 deliveries, each to an execution that got interrupted).

At the end (or at `--deadline`, or on SIGINT/SIGTERM) it checks, and exits 1 on any violation:
every run `finished`, its checkpoint holding its four tool nodes and the answer it was given; one
`run_finished` event per run and a completion-ledger line; every ledger line of a node beyond
the first comes from an execution that was interrupted while it ran the node — its runner was
killed, drained or crashed soon after, its lease was lost, or a store/NATS fault window was
around it — and never from an execution that had recorded `node_finished` for it (SPEC §13.6);
every execution of a run that spent its delivery budget was interrupted the same way; no run
stayed `queued`/`running`/auto-resumable with no lease and no message longer than the
sweeper's interval plus grace (+ slack, SPEC §13.5); no live lease is left at the end; the DLQ
holds exactly the deliberate poison, each with its reason; no record ever stood for a real run
unless the soak dead-lettered it (a spent delivery budget's park, replayed, or such a park's
record withdrawn excepted), none names a store error, and no run stood `queued`/`running`
behind one; no runner died on its own; every drain exited 0 within the unwind ceiling and
handed off the runs it held mid-node.

The package, one concept a module:

- `__main__.py`: the command line: its options, the soak run, the report printed, the exit code.
- `run.py`: the soak put together (`Soak`) and its main flow (`run_soak`): start the fleet,
  drive the runs through the chaos, judge them, clean up.
- `config.py`: what one soak is asked to do (`SoakConfig`) and the fleet's short timings.
- `workflow.py`: the soak's workflow and the ledger its tool nodes write.
- `fleet.py`: one soak's state and its fleet: the servers, the store, the runner processes.
- `workload.py`: the runs' traffic: launches, answers to the human pauses, DLQ replays.
- `faults.py`: the chaos: every fault, on a plan keyed to the runs finished.
- `watch.py`: the checks made while the runs flow (orphans, runs behind a DLQ record).
- `verdict.py`: the checks at the end, run by run.
- `report.py`: the report and its table, and the known findings a violation may name.
- `reads.py`: paged reads of the store.
"""

from __future__ import annotations

from tests.soak.config import TIMING, SoakConfig
from tests.soak.fleet import READY, REPO, RunnerProc
from tests.soak.report import Report, known_finding
from tests.soak.run import Soak, run_soak

__all__ = [
    "READY",
    "REPO",
    "TIMING",
    "Report",
    "RunnerProc",
    "Soak",
    "SoakConfig",
    "known_finding",
    "run_soak",
]
