"""How an operation's failure reads to whoever called it (SPEC §10, §10c).

Operations raise only `RunfleetError`s: a usage error (`SettingsInvalid`: a `RUNFLEET_*`
variable runfleet cannot use) — the CLI's exit 2, the API's 400 —, typed refusals (`Refusal`,
and `WorkflowInvalid`, a refusal of the file a person gave) — the CLI's exit 3, the API's 4xx
—, infrastructure that is not there — exit 4, 503 with `Retry-After` —, and anything else —
exit 1. One table here, so the CLI, the console and the API classify alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.attachment_intake import LaunchFailed
from engine.errors import WorkflowInvalid
from engine.sandbox.kubernetes.settings import KubernetesSettingsInvalid
from publisher.errors import ConsumerMismatch, NatsUnavailable, PublishFailed
from store import Refusal, RunfleetError, StoreUnavailable
from store.settings import SettingsInvalid

UNREACHABLE: tuple[type[RunfleetError], ...] = (StoreUnavailable, NatsUnavailable, PublishFailed)
"""NATS (a missing stream, a JetStream that does not answer, a timeout) or the store is not
there; `PublishFailed` comes after the publisher's bounded retries, and the run was put back."""


class RunIdAmbiguous(Refusal, code="run_id_ambiguous"):
    """A run id prefix that starts the ids of several of the tenant's runs (SPEC §10)."""

    remedy = "give more characters of the run id (or all of it)"

    def __init__(self, prefix: str, candidates: list[str], *, more: bool = False) -> None:
        listed = ", ".join(candidates) + (", ..." if more else "")
        super().__init__(f"run id prefix {prefix!r} starts several runs: {listed}")
        self.candidates = tuple(candidates)

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "candidates": list(self.candidates)}


class IdempotencyKeyReused(Refusal, code="idempotency_key_reused"):
    """A launch whose `Idempotency-Key` already made a run from a different request: answering
    with that run would tell the caller its new workflow, vars or attachments were queued."""

    remedy = (
        "use a new Idempotency-Key for a different launch (a retry must repeat the first"
        " request's workflow, vars and attachment names)"
    )


class NotConfirmed(Refusal, code="not_confirmed"):
    """A destructive command (`dlq purge`, `gc`) whose question was answered no, or could not
    be asked (no terminal): nothing was removed."""

    remedy = "answer y at the question, or pass --yes to run it without asking (a script)"


def _in_order(pids: Sequence[int], servers: Sequence[int]) -> str:
    """How to stop what a killed `up` left: the runners first, and the nats-server only once
    they are gone — one `kill` of both cut the runners' handoff publishes off (found by a
    walkthrough: `run_publish_failed`, the handoff left to the next fleet's sweeper)."""
    runners = [p for p in pids if p not in servers]
    nats = [p for p in pids if p in servers]
    if not runners or not nats:
        return f"`kill {' '.join(map(str, pids))}`"
    first, then = " ".join(map(str, runners)), " ".join(map(str, nats))
    return (
        f"`kill {first}` (the runners: they hand off their runs), wait until they have exited,"
        f" then `kill {then}` (the nats-server)"
    )


class FleetAlreadyRunning(Refusal, code="fleet_already_running"):
    """A second `runfleet up` on a data dir whose fleet runs: it would start a second
    nats-server on the same JetStream store, a second sweeper over the same SQLite file, and
    take `nats.url` from the fleet the other commands use."""

    def __init__(
        self,
        data: Path,
        pid: int | None,
        orphans: Sequence[int] = (),
        *,
        lock_deleted: bool = False,
        servers: Sequence[int] = (),
        unlocked: bool = False,
    ) -> None:
        pids = " ".join(str(p) for p in orphans)
        if unlocked:
            # A server on this dir's JetStream store that holds no lock: an `up` of a build
            # before the lock (ADR-0018), or a server started by hand (an upgrade walkthrough).
            who = f"a nats-server on its JetStream store that holds no up.lock: pids {pids}"
            stop = f"stopping that fleet, or `kill {pids}` once its runners are stopped"
        elif lock_deleted:
            who = f"its processes still hold {data}/up.lock, which was deleted: pids {pids}"
            stop = f"`kill {pids}` (never delete up.lock)"
        elif orphans:
            # The `up` is gone (SIGKILL) but the servers and runners it started still run.
            who = f"processes left by a `runfleet up` that is gone: pids {pids}"
            stop = _in_order(orphans, servers)
        elif pid is not None:
            who, stop = f"pid {pid}", f"`kill {pid}`"
        else:
            who, stop = "a process that has not written its pid yet", "`kill` on that `up`"
        super().__init__(
            f"a fleet is already running on {data} ({who}); one data dir serves one fleet",
            remedy=f"use that fleet (every other command finds it through {data}/nats.url), or"
            f" stop it (Ctrl-C in its shell, or {stop}), or start another fleet with"
            " `--data DIR` (or RUNFLEET_DATA) naming another directory",
        )
        self.data = data
        self.pid = pid if not orphans else None
        self.orphans = tuple(orphans)

    def to_dict(self) -> dict[str, object]:
        return {
            **super().to_dict(),
            "data": str(self.data),
            "pid": self.pid,
            "orphans": list(self.orphans),
        }


USAGE: tuple[type[RunfleetError], ...] = (
    SettingsInvalid,
    KubernetesSettingsInvalid,
    ConsumerMismatch,
)
"""A setting that cannot be used: a `RUNFLEET_*` value (`store.settings`), or the kubernetes
driver's settings judged together when it opens (an image required, a pod template that does
not parse), or settings that contradict the fleet's consumer (`ConsumerMismatch`)."""


def _meant(exc: RunfleetError) -> RunfleetError:
    """A failure that says what stopped it reads as that: a launch whose attachments could
    not be promoted because the blob store was down is "unreachable" (503, exit 4: retry),
    not an internal error."""
    if isinstance(exc, LaunchFailed) and isinstance(exc.__cause__, RunfleetError):
        return _meant(exc.__cause__)
    return exc


def is_usage(exc: RunfleetError) -> bool:
    """A value the person gave (a setting) cannot be used: they fix it and try again."""
    return isinstance(_meant(exc), USAGE)


def is_refusal(exc: RunfleetError) -> bool:
    return isinstance(_meant(exc), Refusal | WorkflowInvalid)


def is_unreachable(exc: RunfleetError) -> bool:
    return isinstance(_meant(exc), UNREACHABLE)
