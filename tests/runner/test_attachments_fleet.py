"""Attachments through the queue, end to end with real processes (SPEC §8, §6.4, §13.11).

The operator's CLI (`launch --attach`, `resume --answer field=@PATH`) runs in its own process
with the operator's data directory; each `runfleet runner` runs in another process with a data
directory of its own, sharing only the store, the blob store and NATS. The operator's files are
deleted before the runner that reads them starts, so the bytes a node prints can only have come
through the blob store.
"""

from __future__ import annotations

import json

from store import RunDocument, RunStatus
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import run_cli, runner_process

WORKFLOW = """\
name: attached
entry: show_spec
nodes:
  show_spec:
    kind: tool
    run: cat {{ attachments.spec.path }}
    output: text
  ask:
    kind: human
    questions:
      - name: doc
        type: file
  show_doc:
    kind: tool
    run: cat {{ attachments.doc.path }}
    output: text
edges:
  - from: show_spec
    to: ask
  - from: ask
    to: show_doc
"""


async def _wait(fleet: Fleet, run_id: str, status: RunStatus) -> RunDocument:
    async def reached() -> RunDocument | None:
        run = await fleet.store.get_run(run_id)
        return run if run.status is status else None

    return await eventually(reached, within=60.0)


async def test_a_file_answer_given_with_at_path_is_read_by_a_runner_in_another_process_with_its_own_data_directory(  # noqa: E501
    fleet: Fleet,
) -> None:
    operator = fleet.tmp / "operator"
    operator.mkdir()
    source = operator / "wf.yaml"
    source.write_text(WORKFLOW)
    spec = operator / "spec.txt"
    spec.write_text("the launch spec\n")
    answer = operator / "answer.txt"
    answer.write_text("the operator's answer\n")

    launched = await run_cli(fleet, "launch", str(source), "--attach", f"spec={spec}", "--json")
    assert launched.returncode == 0, launched.stderr
    view = json.loads(launched.stdout)
    run_id = view["run_id"]
    assert [a["name"] for a in view["attachments"]] == ["spec"]
    spec.unlink()

    async with runner_process(
        fleet, "runner-a", env={"RUNFLEET_DATA": str(fleet.tmp / "runner-a")}
    ) as first:
        paused = await _wait(fleet, run_id, RunStatus.PAUSED_WAITING_HUMAN)
        await first.stop()
    assert paused.checkpoint is not None
    assert paused.checkpoint.outputs["show_spec"] == "the launch spec"

    resumed = await run_cli(fleet, "resume", run_id, "--answer", f"doc=@{answer}", "--json")
    assert resumed.returncode == 0, resumed.stderr
    queued = await fleet.store.get_run(run_id)
    assert queued.resume_spec is not None
    sent = queued.resume_spec.answers["doc"]
    assert set(sent) == {"upload", "filename", "bytes", "sha256"}  # an id, never a path
    answer.unlink()

    async with runner_process(
        fleet, "runner-b", env={"RUNFLEET_DATA": str(fleet.tmp / "runner-b")}
    ):
        done = await _wait(fleet, run_id, RunStatus.FINISHED)

    assert done.checkpoint is not None
    assert done.checkpoint.outputs["show_doc"] == "the operator's answer"
    held = {a.name: a for a in done.attachments}
    assert set(held) == {"spec", "doc"}
    assert held["doc"].filename == "answer.txt"
    assert held["doc"].key == f"runs/{run_id}/attachments/doc"
    assert await fleet.blobs.list("uploads/") == []  # the staged answer was promoted


async def test_runfleet_upload_prints_an_id_a_launch_attaches_and_a_bad_name_is_refused_exit_3(
    fleet: Fleet,
) -> None:
    source = fleet.tmp / "wf.yaml"
    source.write_text(WORKFLOW)
    spec = fleet.tmp / "spec.txt"
    spec.write_text("uploaded spec\n")

    uploaded = await run_cli(fleet, "upload", str(spec), "--json")
    assert uploaded.returncode == 0, uploaded.stderr
    upload = json.loads(uploaded.stdout)
    assert upload["files"] == [
        {"filename": "spec.txt", "bytes": 14, "sha256": upload["files"][0]["sha256"]}
    ]
    plain = await run_cli(fleet, "upload", str(spec))
    assert plain.returncode == 0 and len(plain.stdout.strip()) == 32

    launched = await run_cli(
        fleet, "launch", str(source), "--attach", f"spec=upload:{upload['upload_id']}", "--json"
    )
    assert launched.returncode == 0, launched.stderr
    (held,) = json.loads(launched.stdout)["attachments"]
    assert (held["name"], held["filename"], held["bytes"]) == ("spec", "spec.txt", 14)

    refused = await run_cli(fleet, "launch", str(source), "--attach", f"Spec={spec}", "--json")
    assert refused.returncode == 3, refused.stderr
    assert json.loads(refused.stdout)["error"]["code"] == "attachment_name_invalid"


async def test_an_unknown_upload_id_is_refused_upload_not_found_exit_3_as_the_api_does_404(
    fleet: Fleet,
) -> None:
    """The same refusal, code and remedy from the operations for both surfaces (the API's
    side: tests/console/test_api_uploads.py): an upload id the tenant has no upload by —
    here one already promoted by a launch — refuses the next launch before anything moves."""
    source = fleet.tmp / "wf.yaml"
    source.write_text(WORKFLOW)
    spec = fleet.tmp / "spec.txt"
    spec.write_text("uploaded spec\n")
    upload_id = (await run_cli(fleet, "upload", str(spec))).stdout.strip()
    first = await run_cli(fleet, "launch", str(source), "--attach", f"spec=upload:{upload_id}")
    assert first.returncode == 0, first.stderr

    again = await run_cli(
        fleet, "launch", str(source), "--attach", f"spec=upload:{upload_id}", "--json"
    )
    assert again.returncode == 3, again.stdout + again.stderr
    error = json.loads(again.stdout)["error"]
    assert error["code"] == "upload_not_found" and error["remedy"]
