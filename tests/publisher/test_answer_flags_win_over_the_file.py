"""SPEC §6.4: answers come as strings from `--answer k=v` (coerced to the question's type) and
as typed JSON from `--answers-file`; for the same question the flags win over the file.

An operator who keeps a standing answers file and corrects one answer on the command line
must get the correction. The audit let the file win and no test noticed. The resume is the
real publisher's, on a real store and JetStream; the answers are read back from the
`resume_spec` the fresh claim will apply.
"""

from __future__ import annotations

from engine.resume import ResumeRequest
from publisher import Publisher
from store import Checkpoint, RunDocument, RunStatus, RunStore
from tests.publisher.conftest import approval_pending, put_run


async def waiting_for_approval(run_store: RunStore) -> RunDocument:
    """`approval.yaml` paused at its question, `approved` (a bool) and `note` (a string)."""
    return await put_run(
        run_store,
        status=RunStatus.PAUSED_WAITING_HUMAN,
        workflow="approval.yaml",
        checkpoint=Checkpoint(
            progress=1, completed=["prepare"], pending_interaction=approval_pending()
        ),
    )


async def test_spec_6_4_answer_flags_win_over_the_answers_file_for_the_same_question(
    publisher: Publisher, run_store: RunStore
) -> None:
    run = await waiting_for_approval(run_store)
    request = ResumeRequest(
        answers={"approved": True, "note": "from the file"},  # --answers-file (typed JSON)
        cli_answers={"approved": "false", "note": "from a flag"},  # --answer k=v
    )

    resumed = await publisher.resume(run.run_id, request, tenant="default")

    assert resumed.resume_spec is not None
    assert resumed.resume_spec.answers == {"approved": False, "note": "from a flag"}


async def test_spec_6_4_the_answers_file_still_answers_what_no_flag_names(
    publisher: Publisher, run_store: RunStore
) -> None:
    """Flags win per question, not wholesale: the file's other answers stay."""
    run = await waiting_for_approval(run_store)
    request = ResumeRequest(
        answers={"approved": True, "note": "from the file"},
        cli_answers={"approved": "false"},
    )

    resumed = await publisher.resume(run.run_id, request, tenant="default")

    assert resumed.resume_spec is not None
    assert resumed.resume_spec.answers == {"approved": False, "note": "from the file"}
