"""Run ids as people type them (SPEC §10 v2.2): the whole id, or any unique prefix of at least
`MIN_PREFIX` characters.

Run ids are time-ordered (UUIDv7) and the store pages on them in order, so the runs whose id
starts with a prefix are the first ones after the prefix itself: one keyset read answers it,
whatever the size of the store. Only the tenant's runs are candidates (another tenant's run
does not exist here, as `Publisher.get_run` says).
"""

from __future__ import annotations

from runner.operations.env import Env
from runner.operations.errors import RunIdAmbiguous
from store import DocumentInvalid, RunNotFound, RunQuery

MIN_PREFIX = 6
SHOWN = 10
"""Candidates an ambiguous prefix lists (and the read's limit, plus one)."""


async def resolve_run_id(env: Env, given: str, *, tenant: str | None = None) -> str:
    """The run id `given` names: itself when the tenant (`env.tenant` unless given) has that
    run, else the one run of the tenant whose id starts with it. `RunNotFound` when none does
    (or it is shorter than `MIN_PREFIX`), `RunIdAmbiguous` listing the candidates when several
    do. A run whose stored document does not validate is named too (it is the tenant's by its
    indexed tenant): what to do with it is the caller's (`status` says it does not validate,
    a page continues after it)."""
    tenant = tenant or env.tenant
    try:
        if (await env.store.get_run(given)).tenant == tenant:
            return given
        # Another tenant's run: answered below exactly as an id no run has (an API walkthrough
        # told the two apart by the message), never confirmed to exist.
    except DocumentInvalid:
        page = await env.store.list_runs(RunQuery(run_ids=[given], tenant=tenant))
        if any(bad.run_id == given for bad in page.unreadable):
            return given
    except RunNotFound:
        if len(given) < MIN_PREFIX:
            raise RunNotFound(
                f"no run {given!r}",
                remedy=f"give the run id, or at least {MIN_PREFIX} of its first characters"
                " (`runfleet runs` lists them)",
            ) from None
    page = await env.store.list_runs(RunQuery(tenant=tenant, after_run_id=given, limit=SHOWN + 1))
    matches = [run.run_id for run in page.runs if run.run_id.startswith(given)]
    if not matches:
        raise RunNotFound(f"no run {given!r} (as an id or the start of one)")
    if len(matches) > 1:
        raise RunIdAmbiguous(given, matches[:SHOWN], more=len(matches) > SHOWN)
    return matches[0]
