"""The checks at the end: `Verdict.analyse` reads every run, its events, the ledgers, the
drains, the DLQ and every runner's log, and fills the report: the counts, and a violation for
every invariant broken (the package's docstring lists them). A node that ran again must be
explained by an interruption (`explain`): its runner ended soon after, a fault window was
around it, or it lost its lease.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict
from typing import Any

from runner.delivery_log import read_deliveries
from runner.operations.retry_wait import RetryWait, retry_wait
from store import RunDocument, RunStatus, utcnow
from tests.soak.config import ACK_WAIT_S, SQLITE_BUSY_TIMEOUT_S, TIMING
from tests.soak.fleet import Fleet, RunnerProc
from tests.soak.reads import _events, _list
from tests.soak.report import Report
from tests.soak.workflow import COMPLETED, LEDGER_NODES, _ledger
from tests.soak_soundings import count_dedupe_answers, count_redeliveries

_STATUS_REFUSED = re.compile(r"run (?P<run>\S+): status not written \((?P<error>\w+)")
_STORE_ERROR = re.compile(r"Store\w*Error|StoreUnavailable|store_un\w+|database is locked")


class Verdict(Fleet):
    """The end of the soak: every run judged, the report filled."""

    async def analyse(self) -> Report:
        assert self.store is not None and self.dlq is not None
        rep = self.report
        rep.wall_s = time.monotonic() - self.started
        rep.data_dir = str(self.root)
        rep.runs = len(self.launched)
        rep.launch_refused = len(self.refused)
        rep.poison = len(self.poison)
        if self.interrupted:
            rep.interrupted = True
            rep.violations.append("interrupted (SIGINT/SIGTERM) before every run finished")
        if len(self.launched) < self.cfg.runs:
            rep.violations.append(f"only {len(self.launched)} of {self.cfg.runs} runs launched")
        await self.leases_settle(within=ACK_WAIT_S + 2.0)
        rep.dedupe_answered = self.dedupe.count + count_dedupe_answers(
            proc.log() for proc in self.history
        )
        assert self.js is not None
        try:
            rep.redeliveries = await count_redeliveries(self.js, self.names)
        except Exception as exc:  # noqa: BLE001 - evidence only: the verdict does not need it
            self.say(f"delivery log not read: {exc!r}")
        lines = _ledger(self.ledger)
        completions = _ledger(self.done)
        killed_like = {rp.owner: rp for rp in self.history if rp.owner and rp.ended}
        for run_id in self.launched:
            doc = await self.store.get_run(run_id)
            events = self.events[run_id] = await _events(self.store, run_id)
            before = len(rep.violations)
            waiting = await retry_wait(self.store, doc, int(TIMING["MAX_DELIVER"]))
            self.judge_run(
                doc,
                events,
                lines.get(run_id, []),
                completions.get(run_id, []),
                killed_like,
                waiting,
            )
            if doc.status is not RunStatus.FINISHED and len(rep.violations) > before:
                rep.violations[-1] += "\n" + await self.history_of(doc, events)
        self.judge_drains()
        records = await self.dlq.list()
        rep.dlq_records = len(records)
        self.judge_status_refusals()
        self.judge_dlq_history(standing={r.id for r in records})
        got = {r.id: r.reason for r in records}
        if got != self.poison:
            extra = {k: v for k, v in got.items() if k not in self.poison}
            missing = {k: v for k, v in self.poison.items() if k not in got}
            wrong = {k: (got[k], v) for k, v in self.poison.items() if k in got and got[k] != v}
            rep.violations.append(
                f"DLQ differs from the deliberate poison: extra {extra}, missing {missing},"
                f" wrong reason (got, want) {wrong}"
            )
        return rep

    async def leases_settle(self, within: float) -> None:
        """The last release follows the last status write by a moment: let it land."""
        assert self.reader is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            runs = await _list(self.reader, list(RunStatus))
            now = utcnow()
            if not any(r.lease is not None and r.lease.expires_at > now for r in runs):
                return
            await asyncio.sleep(0.2)

    def judge_run(
        self,
        doc: RunDocument,
        events: list[Any],
        lines: list[tuple[float, str, str]],
        completions: list[tuple[float, str, str]],
        ended: dict[str, RunnerProc],
        waiting: RetryWait | None = None,
    ) -> None:
        """`waiting`: the retry the run waits for (`runner.operations.retry_wait`, what
        `runfleet status` shows). A run whose retry is due after the soak ended is not lost
        (its copy is nak'd with the delay and comes back), but the soak did not leave it the
        time: it is counted `stuck`."""
        rep = self.report
        rid = doc.run_id
        claims = {e.execution: e for e in events if e.type == "run_claimed"}
        finished_nodes = {
            (e.execution, e.data.get("node")) for e in events if e.type == "node_finished"
        }
        if any(
            e.type == "node_failed"
            and e.data.get("node") == "flaky"
            and e.data.get("code") == "TOOL_FAILED_TRANSIENT"
            for e in events
        ):
            rep.transient_retries += 1
        rep.handoffs += sum(
            1 for e in events if e.type == "run_queued" and e.data.get("kind") == "handoff"
        )
        if doc.status is RunStatus.FINISHED:
            rep.finished += 1
            cp = doc.checkpoint
            if cp is None or list(cp.completed) != list(COMPLETED):
                rep.violations.append(
                    f"run {rid} finished with completed nodes {cp.completed if cp else None}"
                )
            elif (cp.outputs.get("approve") or {}).get("approved") is not True:
                rep.violations.append(f"run {rid} finished without its answer: {cp.outputs}")
            finishes = sum(1 for e in events if e.type == "run_finished")
            if finishes > 1:
                rep.duplicated += 1
                rep.violations.append(f"run {rid} has {finishes} run_finished events")
            elif finishes == 0:
                rep.missing_events += 1
                owner = doc.lease.owner if doc.lease is not None else "?"
                rep.violations.append(
                    f"run {rid} is finished but has no run_finished event (runner {owner} wrote"
                    " the status and died before the event; nothing repairs it)"
                )
            if not completions:
                rep.violations.append(f"run {rid} finished but its final node left no line")
        else:
            orphan = doc.lease is None and doc.status in (
                RunStatus.QUEUED,
                RunStatus.RUNNING,
                RunStatus.FAILED_RESUMABLE,
            )
            retry = waiting.describe() if waiting and waiting.seconds_left() > 0 else None
            if orphan and retry is None:
                rep.lost += 1
            else:
                rep.stuck += 1
            rep.violations.append(
                f"run {rid} ended {doc.status} {doc.failure_code or ''} attempt {doc.attempt}"
                f" lease {doc.lease} publication {doc.publication}: "
                + (
                    f"waiting out its retry delay, {retry} (SPEC §5.5 ladder)"
                    if retry
                    else ("lost (no owner)" if orphan else "stuck")
                )
            )
        if doc.lease is not None and doc.lease.expires_at > utcnow():
            rep.violations.append(f"run {rid} is {doc.status} and still leased: {doc.lease}")
        elif doc.lease is not None:
            rep.stale_leases += 1  # its runner died between the status write and the release
        by_node: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for at, node, token in lines:
            by_node[node].append((at, token))
        if doc.status is RunStatus.FINISHED:
            for node in LEDGER_NODES:
                if not by_node.get(node):
                    rep.violations.append(f"run {rid}: node {node} completed but never ran")
        duplicated = False
        for node, runs in by_node.items():
            runs.sort()
            tokens = [t for _, t in runs]
            if len(set(tokens)) != len(tokens):
                duplicated = True
                rep.violations.append(f"run {rid}: node {node} ran twice in one execution {tokens}")
            for at, token in runs[:-1]:  # every line but the last was cut short
                rep.rerun_nodes += 1
                if (token, node) in finished_nodes:
                    duplicated = True
                    rep.violations.append(
                        f"run {rid}: node {node} completed by execution {token} (node_finished)"
                        f" and executed again (SPEC §13.6)"
                    )
                    continue
                cause = self.explain(rid, token, at, claims, ended)
                rep.rerun_causes[cause] += 1
                if cause == "unexplained":
                    duplicated = True
                    claim = claims.get(token)
                    rep.violations.append(
                        f"run {rid}: node {node} re-ran after execution {token}"
                        f" (runner {claim.data.get('runner') if claim else '?'}) though nothing"
                        " interrupted it"
                    )
        rep.duplicated += duplicated
        for attempt, record_id in self.parked.get(rid, []):
            for claim in (e for e in events if e.type == "run_claimed" and e.attempt == attempt):
                why = self.explain(
                    rid, claim.execution, claim.at.timestamp(), claims, ended, within=60.0
                )
                if why == "unexplained":
                    rep.violations.append(
                        f"run {rid}: attempt {attempt} spent its delivery budget (DLQ record"
                        f" {record_id}), yet execution {claim.execution} of it was not interrupted"
                    )

    async def history_of(self, doc: RunDocument, events: list[Any]) -> str:
        """Everything the soak can still read about a run that did not finish, printed with
        its violation: a loss seen once in CI cannot be run again with the same timing, so the
        evidence has to come out with the failure. Its events, what each delivery of it became
        (the delivery log), whether its copy is still on the work stream, and every runner log
        line that names it or its copy's sequence."""
        rid = doc.run_id
        out = [f"history of run {rid} (status {doc.status}, attempt {doc.attempt}):"]
        for e in events:
            out.append(f"  event {e.at:%H:%M:%S.%f} a{e.attempt} {e.type} {dict(e.data)}")
        seqs: set[int] = set()
        if doc.publication is not None and doc.publication.stream_seq is not None:
            seqs.add(doc.publication.stream_seq)
        assert self.js is not None
        try:
            for _, d in await read_deliveries(self.js, self.names, rid):
                seqs.add(d.stream_seq)
                out.append(
                    f"  delivery {d.at:%H:%M:%S.%f} seq {d.stream_seq} #{d.num_delivered}"
                    f" a{d.attempt} {d.action} {d.reason} delay={d.delay} record={d.record_id}"
                    f" by {d.runner}"
                )
        except Exception as exc:  # noqa: BLE001 - evidence only
            out.append(f"  delivery log not read: {exc!r}")
        for seq in sorted(seqs):
            try:
                await self.js.get_msg(self.names.runs_stream, seq)
                out.append(f"  copy seq {seq}: still on the work stream")
            except Exception as exc:  # noqa: BLE001 - evidence only
                out.append(f"  copy seq {seq}: {type(exc).__name__}")
        try:
            info = await self.js.consumer_info(self.names.runs_stream, self.names.consumer)
            out.append(
                f"  consumer: pending {info.num_pending} ack_pending {info.num_ack_pending}"
                f" redelivered {info.num_redelivered} ack_floor {info.ack_floor}"
            )
        except Exception as exc:  # noqa: BLE001 - evidence only
            out.append(f"  consumer info not read: {exc!r}")
        alternatives = "|".join([re.escape(rid), *(rf"seq[ =]{s}\b" for s in seqs)])
        named = re.compile(alternatives)
        for proc in self.history:
            for line in proc.log().splitlines():
                if named.search(line):
                    out.append(f"  {proc.owner or proc.index}: {line[:300]}")
        return "\n".join(out)

    def explain(
        self,
        run_id: str,
        token: str,
        at: float,
        claims: dict[str | None, Any],
        ended: dict[str, RunnerProc],
        within: float = 30.0,
    ) -> str:
        """Why an execution that was doing something at `at` (epoch s) did not finish it: its
        runner ended (killed, drained, crashed) within `within` s after, a store or NATS fault
        window was around it, or its runner logged the lease lost. Else `unexplained`."""
        claim = claims.get(token)
        owner = claim.data.get("runner") if claim is not None else None
        rp = ended.get(owner or "")
        if rp is not None and at <= rp.ended_at <= at + within:
            return {"killed": "kill", "drained": "drain", "crashed": "crash"}.get(rp.ended, "?")
        for w in self.windows:
            start = time.time() - (time.monotonic() - w.start)
            end = time.time() - (time.monotonic() - w.end) if w.end != float("inf") else 1e12
            if start - (SQLITE_BUSY_TIMEOUT_S + 10.0) <= at <= end + 5.0:
                return f"{w.kind}_fault"
        for proc in self.history:
            if proc.owner == owner and (
                f"run {run_id}: lease lost" in (log := proc.log())
                or f"run {run_id}: lease {token} taken over" in log
            ):
                return "lease_lost"
        return "unexplained"

    def judge_status_refusals(self) -> None:
        """Count the status writes the store refused (`status not written`), and those the
        post-engine faults caught."""
        refused: set[str] = set()
        for proc in self.history:
            for found in _STATUS_REFUSED.finditer(proc.log()):
                self.report.status_refused += 1
                if found["error"] == "StoreUnavailable":
                    refused.add(found["run"])
        self.report.post_engine_refused = sum(1 for run_id in self.caught if run_id in refused)

    def judge_dlq_history(self, standing: set[int]) -> None:
        """No DLQ record for a real run unless the soak dead-lettered it on purpose (its poison
        names a real run too) — with one exception chaos earns: a run whose delivery budget was
        spent, parked and replayed by the soak (`replay`; every execution of that attempt must
        have been interrupted, `judge_run`), or such a park's record withdrawn because the park
        did not land (ADR-0010). A store outage never makes a record (SPEC v2.2 §5.1, §5.6)."""
        rep = self.report
        real = set(self.launched) | set(self.refused)
        replayed = {record_id for pairs in self.parked.values() for _, record_id in pairs}
        for record_id, (_, rec) in sorted(self.dlq_seen.items()):
            if record_id in self.poison:
                continue
            about = (
                f"DLQ record {record_id} ({rec.reason}: {rec.detail[:200]}) for run {rec.run_id}"
            )
            withdrawn = record_id not in standing and record_id not in replayed
            if withdrawn and rec.reason == "retries_exhausted":
                rep.dlq_withdrawn += 1  # written first at a last delivery; the park did not land
            elif _STORE_ERROR.search(rec.detail):
                rep.violations.append(f"{about}: a store outage made a DLQ record")
            elif record_id in replayed:
                rep.dlq_chaos += 1
            elif rec.run_id in real:
                rep.violations.append(f"{about}: a real run the soak did not dead-letter")
            # else: a record for no real run, not poison: the exact-DLQ check names it if it stands

    def judge_drains(self) -> None:
        rep = self.report
        for drain in self.drain_log:
            if drain.outage:
                continue  # its handoffs cannot publish; the orphan checks judge the sweeper
            for run_id, attempt in drain.held.items():
                events = self.events.get(run_id, [])
                handed = any(
                    e.type == "run_queued"
                    and e.data.get("kind") == "handoff"
                    and e.data.get("attempt") == attempt + 1
                    for e in events
                )
                completed_first = any(
                    e.type == "node_finished"
                    and e.execution == drain.tokens.get(run_id)
                    and e.data.get("node") == "finish"
                    for e in events
                )
                if not handed and not completed_first:
                    rep.violations.append(
                        f"drain of {drain.owner}: run {run_id} (attempt {attempt}, at `work`)"
                        " was not handed off"
                    )
