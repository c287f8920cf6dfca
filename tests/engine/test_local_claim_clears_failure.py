"""SPEC §5.3 (claim): every claim clears `failure_code` and `error` — here the *local* claim
(`runfleet resume RUN --local`), which resumes and claims in one CAS of its own (`claim_local`),
apart from the runner's claims that `tests/runner/test_claim_clears_failure.py` covers.

A run failed deliberately and resumable; the local resume claims it again. The claimed document
is read before anything executes under the new lease: the later outcome's status write would
overwrite the failure fields anyway and hide a claim that left them standing. Both stores.
"""

from __future__ import annotations

from engine.loader import load_workflow
from engine.local import LocalEnv, claim_local, run_local
from engine.resume import ResumeRequest
from store import RunStatus

DELIBERATE_RESUMABLE = """\
name: deliberate_resumable
entry: guard
nodes:
  guard:
    kind: compute
    set:
      ok: "False"
  refuse:
    kind: fail
    code: BOT_REFUSED
    message: "the guard said no"
    resumable: true
  done:
    kind: compute
    set:
      x: "1"
edges:
  - from: guard
    to: done
    when: outputs.guard.ok
  - from: guard
    to: refuse
"""


async def test_spec_5_3_a_local_resume_claim_clears_failure_code_and_error(
    env: LocalEnv,
) -> None:
    loaded = load_workflow(DELIBERATE_RESUMABLE, "deliberate_resumable.yaml")
    failed = await run_local(env, loaded, {})
    assert failed.status is RunStatus.FAILED_RESUMABLE
    assert failed.failure_code == "BOT_REFUSED" and failed.error

    claimed = await claim_local(env, failed, ResumeRequest())

    assert (claimed.status, claimed.attempt) == (RunStatus.RUNNING, 2)
    assert claimed.lease is not None and claimed.lease.attempt == 2
    assert (claimed.failure_code, claimed.error) == (None, None)
    stored = await env.store.get_run(failed.run_id)
    assert (stored.status, stored.failure_code, stored.error) == (RunStatus.RUNNING, None, None)
