"""The console's fleet page (SPEC v2.2 §10b): the runners with their slots in use (when the
console runs inside `runfleet up`, which knows its runner processes), the leases the runs hold
with their expiry, and the work consumer's lag and ack-pending — live.

A standalone `runfleet console` has no list of runner processes (runners register nowhere);
it shows each lease owner instead, which is every runner that holds a run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from nats.js.errors import NotFoundError

from publisher.nats_errors import nats_boundary
from runner import operations as ops
from runner.console.pages import call_of, fragment, live, page
from runner.embedded import RunnerRow
from store import RunDocument, RunStatus, utcnow


class RunnerSource(Protocol):
    """The rows of the runner processes (`EmbeddedFleet.snapshot`'s), read when asked."""

    def __call__(self) -> Awaitable[Sequence[RunnerRow]]: ...


RUNNERS = web.AppKey("runfleet.ui.runners", RunnerSource)
LEASES_SHOWN = 500


@dataclass(frozen=True)
class LeaseRow:
    run: RunDocument
    owner: str
    expires_in: float
    """Seconds until the lease expires (negative: expired, the sweeper's to recover)."""


async def _consumer(request: web.Request) -> dict[str, Any]:
    env = call_of(request).env
    async with env.publisher() as publisher:
        names = publisher.names
        with nats_boundary("reading the work consumer"):
            try:
                info = await publisher.js.consumer_info(names.runs_stream, names.consumer)
            except NotFoundError:
                return {"name": names.consumer, "missing": True}
    return {
        "name": names.consumer,
        "missing": False,
        "lag": info.num_pending,
        "ack_pending": info.num_ack_pending,
        "redelivered": info.num_redelivered,
        "waiting": info.num_waiting,
        "max_deliver": info.config.max_deliver,
    }


async def _fleet_fragments(request: web.Request) -> dict[str, str]:
    call = call_of(request)
    running = await ops.list_runs(call.env, statuses=[RunStatus.RUNNING], limit=LEASES_SHOWN)
    now = utcnow()
    leases = [
        LeaseRow(r, r.lease.owner, (r.lease.expires_at - now).total_seconds())
        for r in running.runs
        if r.lease is not None
    ]
    owners: dict[str, int] = {}
    for row in leases:
        owners[row.owner] = owners.get(row.owner, 0) + 1
    source = request.config_dict.get(RUNNERS)
    runners = list(await source()) if source is not None else None
    html = fragment(
        "_fleet.html",
        runners=runners,
        leases=sorted(leases, key=lambda row: row.expires_in),
        owners=sorted(owners.items()),
        consumer=await _consumer(request),
    )
    return {"fleet": html}


async def fleet_page(request: web.Request) -> web.Response:
    return page(request, "fleet.html", fragments=await _fleet_fragments(request))


async def fleet_live(request: web.Request) -> web.StreamResponse:
    return await live(request, lambda: _fleet_fragments(request))


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/fleet", fleet_page)
    router.add_get("/fleet/live", fleet_live)
