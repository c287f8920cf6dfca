"""The machine's judgment of what the product does, where it happens: each store write
(`on_write`, a claim's by `_judge_claim`), each event (`on_event`), each ack or nak
(`on_disposition`), each sweeper publish (`on_publish`) and each node start (`run_node`, which
also draws how the node ends), and each actor that ran to its end (`_finished`). Numbers in
parentheses are the invariants of `test_protocol_model.py`'s docstring (SPEC §13).

`Judging` is a mixin of `ProtocolModel` (`machine.py`), which holds the state it reads."""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st

from engine.budget import exceeded
from engine.call_errors import AmbiguousEffect, Permanent, Transient
from engine.cancel import CancelSignal
from engine.failures import FailureCode, is_auto_resumable
from engine.nodes import CallContext
from engine.outcome import CancelReason, Interrupted
from engine.resume import scratch_problem
from publisher.errors import PublishFailed
from publisher.wire import decode
from runner.deliveries import Delivery
from store import Condition, Eq, Event, Refusal, RunDocument, RunStatus, Update
from store.sqlite import SqliteRunStore
from tests.model.actors import ACTOR, Actor
from tests.model.bookkeeping import _seen
from tests.model.broker import Delivered
from tests.model.constants import LOSS_MARGIN, SKEW
from tests.model.faults import POST_ENGINE_STORE
from tests.model.workflow import GUARD, NODE_RESULTS

if TYPE_CHECKING:
    from tests.model.doubles import ModelDlq

S = RunStatus


def _orphanable(doc: RunDocument) -> bool:
    """A status a message must carry on (SPEC §13.5)."""
    return doc.status in (S.QUEUED, S.RUNNING) or (
        doc.status is S.FAILED_RESUMABLE and is_auto_resumable(doc.failure_code)
    )


class Judging:
    """The judging half of `ProtocolModel`."""

    if TYPE_CHECKING:  # what it reads and calls of the machine (`machine.py`)
        raw: SqliteRunStore
        dlq: ModelDlq
        run_id: str
        last_doc: RunDocument
        dead_tokens: dict[str, str]
        hostile: dict[int, str]
        drained: list[CancelSignal]

        def run(self, aw: Awaitable[Any]) -> Any: ...
        def now(self) -> datetime: ...
        def draw(self, strategy: st.SearchStrategy[Any]) -> Any: ...
        def violation(self, kind: str, text: str) -> None: ...

    # -- what the product does, judged where it happens ----------------------------------------

    def on_write(
        self,
        actor: Actor | None,
        pre: RunDocument,
        conds: list[Condition],
        update: Update,
        post: RunDocument,
    ) -> None:
        self.last_doc = post
        who = actor.name if actor is not None else "the lease keeper"
        fields = update.set
        token = next(
            (c.value for c in conds if isinstance(c, Eq) and c.path == "lease.token"), None
        )
        # (1) a token whose lease ended never writes again
        if token is not None and token in self.dead_tokens:
            self.violation("zombie_write", f"{who}: lease {token} had ended; wrote {fields}")
        # (1) SPEC §2: an execution's status and checkpoint writes carry the attempt fence
        if token is not None and ("status" in fields or "checkpoint" in fields):
            fence = [c for c in conds if isinstance(c, Eq) and c.path == "attempt"]
            assert pre.lease is not None
            if not fence or fence[0].value != pre.lease.attempt:
                self.violation("unfenced_write", f"{who}: {sorted(fields)} without the attempt")
        claim = "lease" in fields
        if claim:
            self._judge_claim(who, pre, post)
        if pre.lease is not None and (post.lease is None or post.lease.token != pre.lease.token):
            self.dead_tokens[pre.lease.token] = "self" if token == pre.lease.token else "other"
        # (2) a superseded or duplicate delivery writes nothing
        if actor is not None and actor.verdict in ("superseded", "duplicate"):
            self.violation("superseded_wrote", f"{who} ({actor.verdict}) wrote {sorted(fields)}")
        # (3) consent effects only by the fresh claim of the attempt that carried them
        forsakes = fields.get("scratch.forsaken") is True or (
            isinstance(fields.get("scratch"), dict) and fields["scratch"].get("forsaken")
        )
        rewinding = actor is not None and actor.kind == "rewind"
        effects = [
            name
            for name, present in (
                ("forsaken", forsakes),
                ("workflow", "workflow" in fields and not rewinding),
                ("answers", claim and "checkpoint" in fields),
                ("budget", "budget" in fields),
            )
            if present
        ]
        if effects:
            spec = pre.resume_spec
            fresh = (
                claim
                and pre.status is S.QUEUED
                and spec is not None
                and spec.attempt == pre.attempt
            )
            if not fresh or spec is None:
                self.violation("consent_leak", f"{who} wrote {effects} outside a fresh claim")
            else:
                if forsakes and not spec.consents.accept_scratch_loss:
                    self.violation("consent_leak", f"{who} forsook the scratch without consent")
                if "workflow" in effects and not spec.consents.force:
                    self.violation("consent_leak", f"{who} swapped the source without force")
            for name in effects:
                _seen(f"consent effect:{name}")
        # (4) a park for a dead message follows its DLQ record (SPEC §5.4 (1), §5.6): the
        # runner's and the backstop's alike (record, then park)
        if fields.get("failure_code") == FailureCode.DLQ_PARKED:
            if not self._has_record(pre.run_id, pre.attempt):
                self.violation("parked_without_record", f"{who} parked DLQ_PARKED with no record")
            _seen("dlq parked")
        # (7) attempt and budget accounting never decrease
        if post.attempt < pre.attempt:
            self.violation("attempt_decreased", f"{who}: {pre.attempt} -> {post.attempt}")
        if pre.checkpoint is not None and post.checkpoint is not None:
            a, b = pre.checkpoint.usage, post.checkpoint.usage
            if b.iterations < a.iterations or b.elapsed < a.elapsed or b.cost_usd < a.cost_usd:
                self.violation("usage_decreased", f"{who}: {a} -> {b}")
        # (6) completed nodes are dropped only by a rewind
        before = set(pre.checkpoint.completed) if pre.checkpoint else set()
        after = set(post.checkpoint.completed) if post.checkpoint else set()
        if before - after and not rewinding:
            self.violation("completed_dropped", f"{who} dropped {sorted(before - after)}")
        # (8) no machinery moves a failure it must not retry
        if pre.status is S.FAILED and post.status not in (S.FAILED, S.PAUSED_OPERATOR):
            self.violation("terminal_moved", f"{who}: failed -> {post.status}")
        queued_by_operator = actor is not None and actor.kind == "publisher"
        if post.status is S.QUEUED and pre.status is not S.QUEUED and not queued_by_operator:
            self.violation("queued_by_machinery", f"{who}: {pre.status} -> queued")
        if post.status is not pre.status:
            _seen(f"status:{pre.status}->{post.status}")
        if post.status is S.QUEUED and post.attempt > pre.attempt and not queued_by_operator:
            _seen("hand-on: a draining runner's last delivery became a new attempt")

    def _judge_claim(self, who: str, pre: RunDocument, post: RunDocument) -> None:
        assert post.lease is not None
        if pre.lease is not None and pre.lease.expires_at + timedelta(seconds=SKEW) > self.now():
            self.violation("claim_over_live_lease", f"{who} claimed over {pre.lease.token}")
        if pre.status is S.FAILED_RESUMABLE and not is_auto_resumable(pre.failure_code):
            self.violation("auto_retried", f"{who} claimed a run failed {pre.failure_code}")
        if pre.status not in (S.QUEUED, S.RUNNING, S.FAILED_RESUMABLE):
            self.violation("claimed_settled", f"{who} claimed a {pre.status} run")
        spec = pre.resume_spec
        if pre.status is S.QUEUED and spec is not None and spec.attempt == pre.attempt:
            # (3) ...and the fresh claim of that attempt does write them
            forsaken = post.scratch is not None and post.scratch.forsaken
            if spec.consents.accept_scratch_loss and pre.scratch is not None and not forsaken:
                self.violation("consent_ignored", f"{who}: accepted scratch loss not written")
            swapped = spec.workflow is not None and (
                post.workflow.source_hash == spec.workflow.source_hash
            )
            if spec.consents.force and spec.workflow is not None and not swapped:
                self.violation("consent_ignored", f"{who}: forced source not swapped")
            pending = pre.checkpoint.pending_interaction if pre.checkpoint else None
            if spec.answers and pending is not None:
                out = post.checkpoint.outputs.get(str(pending["node"])) if post.checkpoint else None
                if out != spec.answers:
                    self.violation("consent_ignored", f"{who}: answers not written")
        # (10, partly) a claim leaves neither an unportable scratch nor an exhausted budget
        why = scratch_problem(post)
        if why is not None:
            self.violation("claimed_unportable_scratch", f"{who}: {why}")
        usage = post.checkpoint.usage if post.checkpoint is not None else None
        if usage is not None and exceeded(post.budget, usage) is not None:
            self.violation("claimed_over_budget", f"{who}: {exceeded(post.budget, usage)}")

    def on_event(self, actor: Actor | None, ev: Event, doc: RunDocument) -> None:
        """`doc`: the run as the write that carried `ev` left it (or as read after an append)."""
        if actor is not None and actor.verdict in ("superseded", "duplicate"):
            self.violation("superseded_appended", f"{actor.name} ({actor.verdict}): {ev.type}")
        if ev.execution is not None and self.dead_tokens.get(ev.execution) == "other":
            self.violation("narration_after_loss", f"{ev.type} by lost lease {ev.execution}")
        # (6) the log says a node finished only where the checkpoint says so too: else a resume
        # re-runs a node the log calls finished (the chaos soak found one, issue 19)
        if ev.type == "node_finished":
            node, cp = ev.data.get("node"), doc.checkpoint
            if cp is None or (node not in cp.completed and node not in cp.outputs):
                self.violation("node_finished_without_checkpoint", f"{node}: checkpoint {cp}")
            else:
                _seen("node_finished with its checkpoint")

    def on_disposition(
        self, actor: Actor | None, d: Delivered, action: str, delay: float | None
    ) -> None:
        name = actor.name if actor is not None else "?"
        if action == "nak" and not delay:
            self.violation("nak_without_delay", f"{name}: s{d.seq}")
        live = actor.live if actor is not None else None
        store_refused = actor is not None and bool(actor.faults & POST_ENGINE_STORE)
        if live is not None and self.dead_tokens.get(live.token) == "other":
            drained = (
                isinstance(live.outcome, Interrupted) and live.outcome.reason is CancelReason.DRAIN
            )
            suffix = ":after_store_error" if store_refused else (":handoff" if drained else "")
            self.violation(
                "disposition_after_lease_loss" + suffix,
                f"{name}: {action} s{d.seq}#{d.num_delivered} after its lease {live.token[:8]}"
                " was taken over: it acts on the adopter's message",
            )

    def on_publish(self, actor: Actor | None, payload: bytes) -> None:
        """(8) The sweeper republishes only what it read as eligible (its read may be stale
        by the time it publishes: a copy for a run that moved on is acked as settled)."""
        if actor is None or actor.kind != "sweeper":
            return
        message = decode(payload)
        read = actor.reads.get(message.run_id)
        if read is None:
            self.violation("swept_unread", f"{actor.name} republished a run it did not read")
            return
        if read.status is S.FAILED_RESUMABLE and not is_auto_resumable(read.failure_code):
            self.violation("swept_a_failure", f"republished a run read failed {read.failure_code}")
        if read.status not in (S.QUEUED, S.FAILED_RESUMABLE, S.RUNNING):
            self.violation("swept_settled", f"republished a run read {read.status}")
        pub = read.publication
        record = self.dlq.records.get(pub.stream_seq) if pub and pub.stream_seq else None
        if (
            pub is not None
            and pub.attempt == read.attempt
            and record is not None
            and record.run_id == read.run_id
            and record.attempt == read.attempt
        ):
            self.violation(
                "swept_dead_lettered",
                f"{actor.name} republished attempt {read.attempt}, whose copy s{pub.stream_seq}"
                f" was dead-lettered ({record.reason})",
            )
        _seen(f"sweeper republished a {read.status} run")

    def run_node(self, ctx: CallContext) -> dict[str, Any]:
        actor = ACTOR.get()
        live = actor.live if actor is not None else None
        doc = self.last_doc
        token = live.token if live is not None else "?"
        holder = doc.lease is not None and doc.lease.token == token
        cp = doc.checkpoint
        # (6) a completed, checkpointed node runs again only as a resumable fail's guard
        if holder and cp is not None and ctx.node in cp.completed:
            if ctx.node == GUARD and cp.restart_node == GUARD:
                _seen("guard re-evaluated")
            else:
                self.violation(
                    "completed_node_rerun", f"{ctx.node} re-run by {token[:8]} (checkpoint {cp})"
                )
        # (1, SPEC §13.1) a node starts only while its execution holds the lease short of its
        # loss margin: past it an adopter may hold the run, and fencing stops only the writes,
        # not the node's work. A stalled loop (no beat while time passed) or a claim that
        # landed late reaches a node start before its keeper could say the lease was lost.
        if live is not None:
            lease = doc.lease
            if not holder or lease is None or self.now() >= lease.expires_at - LOSS_MARGIN:
                self.violation(
                    "node_started_past_the_lease_margin",
                    f"{token[:8]} started {ctx.node} at {self.now():%H:%M:%S} with the stored"
                    f" lease {lease}",
                )
            else:
                _seen("node started inside its lease")
        # (v2.2 §5.8) an execution its runner's drain broadcast did not reach (its claim won,
        # or its signal was registered, after the broadcast) is handed off before any node
        svc = actor.svc if actor is not None else None
        draining = live is not None and svc is not None and svc.draining
        if draining and live is not None and not any(live.cancel is c for c in self.drained):
            self.violation("ran_after_drain", f"{token[:8]} ran {ctx.node} after the drain")
        result = self.draw(st.sampled_from(NODE_RESULTS)) or "ok"
        _seen(f"node:{result}")
        if result == "transient":
            raise Transient(FailureCode.NETWORK_TRANSIENT, "flaky")
        if result == "infra":
            raise Transient(FailureCode.SANDBOX_LOST, "gone")
        if result == "permanent":
            raise Permanent(FailureCode.TOOL_FAILED_PERMANENT, "never")
        if result == "ambiguous":
            raise AmbiguousEffect("lost the answer")
        if result == "bot":
            raise Permanent("BOT_GIVES_UP", "no")
        return {"ok": result != "no", "ask": result == "ask"}

    # -- actors that ran to their end ---------------------------------------------------------

    def _finished(self, actor: Actor) -> None:
        """Judge an actor that ran to its end (invariant 4 for deliveries)."""
        if actor.on_done is not None:
            actor.on_done()
        err = actor.error
        if actor.kind in ("publisher", "rewind"):
            if err is not None and not isinstance(err, Refusal | PublishFailed):
                self.violation("operator_error", f"{actor.name}: {err!r}")
            what = actor.name.split(":")[1].split("~")[0]
            _seen(f"{what}:{type(err).__name__ if err else 'ok'}")
            return
        if err is not None:
            self.violation(f"{actor.kind}_error", f"{actor.name} at {actor.label}: {err!r}")
            return
        if actor.kind != "delivery":
            return
        delivery = actor.delivery
        assert delivery is not None
        seq = delivery.info.stream_seq
        if seq in self.hostile:
            record = self.dlq.records.get(seq)
            drained = actor.svc is not None and actor.svc.draining and not delivery.info.is_last
            if drained and delivery.disposed == "nak":
                return  # fetched after SIGTERM: nak'd for the next runner, undecoded (§5.1)
            if delivery.disposed != "ack" or record is None or record.reason != "malformed":
                self.violation(
                    "hostile_not_dead_lettered",
                    f"{actor.name} ({self.hostile[seq]}): {delivery.disposed}, record {record}",
                )
            return
        if delivery.disposed is not None:
            dead = actor.verdict is not None and actor.verdict.startswith("dead:")
            if dead and seq not in self.dlq.records:
                self.violation("dead_without_record", actor.name)
            self._record_settles(actor, seq)
            self._drain_parks_nothing(actor, delivery)
            return
        live = actor.live
        lost = live is not None and (
            live.cancel.reason is CancelReason.LEASE_LOST
            or self.dead_tokens.get(live.token) == "other"
        )
        if not lost:
            self.violation(
                "delivery_vanished",
                f"{actor.name} ended with no ack, nak or DLQ record (verdict {actor.verdict})",
            )
        else:
            _seen("delivery abandoned after its lease was lost")

    def _has_record(self, run_id: str, attempt: int) -> bool:
        return any(r.run_id == run_id and r.attempt == attempt for r in self.dlq.records.values())

    def _record_settles(self, actor: Actor, seq: int) -> None:
        """A delivery that ends with its message's DLQ record standing for the run's current
        attempt has left the run parked or settled: never `queued`, `running` or auto-resumable
        behind the record (a replay would loop it; the sweeper would republish it). Only a
        record this delivery wrote counts: the backstop's record of the same message stands
        between its own record and park (SPEC §5.6), and the backstop answers for it."""
        record = self.dlq.records.get(seq)
        if record is None or record.run_id != self.run_id:
            return
        svc = actor.svc
        if svc is None or record.runner != svc.owner:
            return
        doc = self.run(self.raw.get_run(self.run_id))
        if record.attempt == doc.attempt and _orphanable(doc):
            self.violation(
                "left_behind_record",
                f"{actor.name} ended with record {seq} ({record.reason}) standing and the run"
                f" {doc.status} {doc.failure_code} at attempt {doc.attempt}",
            )

    def _drain_parks_nothing(self, actor: Actor, delivery: Delivery) -> None:
        """(v2.2 §5.8) A draining runner's last delivery is judged, not nak'd unread, and one
        of a run it could claim is handed on (fresh) or handed off (adoption, auto-retry),
        never nak'd to the backstop — unless a fault the machine armed made it nak (a store
        that cannot take the hand-on)."""
        svc = actor.svc
        if svc is None or not svc.draining or not delivery.info.is_last:
            return
        if actor.verdict not in (None, "Claim") or delivery.disposed != "nak" or actor.faults:
            return
        self.violation(
            "drain_naked_last_delivery",
            f"{actor.name}: a draining runner nak'd a last delivery (verdict {actor.verdict})",
        )
