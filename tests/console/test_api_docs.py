"""The cloud-resume example of docs/api.md (issue 22: "the cloud-resume example in docs/api.md
runs as a test"): the Python block is run as written, in its own interpreter, against the API
served over a real fleet with a runner — wait for `paused_waiting_human`, answer, follow the
events to `finished`."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from store import RunStatus
from tests.console.conftest import OP_A, Api
from tests.publisher.conftest import EXAMPLES, REPO

DOC = REPO / "docs" / "api.md"


def example_block(doc: Path) -> str:
    match = re.search(r"<!-- cloud-resume example -->\n```python\n(.*?)```", doc.read_text(), re.S)
    assert match, "docs/api.md lost its cloud-resume example"
    return match.group(1)


async def test_the_cloud_resume_example_of_docs_api_md_answers_a_run_to_finished(
    api: Api,
) -> None:
    await api.fleet.start_runner()
    source = (EXAMPLES / "approval.yaml").read_text()
    status, run, _ = await api.call("POST", "/api/v1/runs", json={"workflow": source})
    assert status == 201

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        example_block(DOC),
        env={
            **os.environ,
            "RUNFLEET_API": api.url.rstrip("/"),
            "RUNFLEET_API_TOKEN": OP_A,
            "RUN_ID": run["run_id"],
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)

    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0].startswith("asked: Approve this change?")
    assert lines[-1] == "ended: finished {'decision': 'approved', 'note': 'ship it'}"
    assert any(line.endswith(" run_finished") for line in lines)
    done = await api.env.store.get_run(run["run_id"])
    assert done.status is RunStatus.FINISHED
