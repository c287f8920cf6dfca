"""Uploads and launch attachments over the HTTP API (SPEC §8, v2.2 §10c): a file staged by
`POST /api/v1/uploads` is attached to a launch by its upload id; an upload is its tenant's
only; the per-file limit refuses before anything is stored."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from runner.console import create_app
from tests.console.conftest import OP_A, OP_B, TOKENS, Api
from tests.publisher.conftest import EXAMPLES

HELLO = (EXAMPLES / "hello.yaml").read_text()
RUN_RESUME = "/api/v1/runs/{run_id}/resume"


async def upload(
    api: Api, data: bytes, filename: str = "spec.txt", token: str = OP_A
) -> dict[str, Any]:
    status, body, _ = await api.call(
        "POST", "/api/v1/uploads", token=token, params={"filename": filename}, data=data
    )
    assert status == 201, body
    return dict(body)


async def test_an_upload_is_attached_to_a_launch_by_its_id(api: Api) -> None:
    staged = await upload(api, b"the spec")
    assert staged["files"] == [
        {"filename": "spec.txt", "bytes": 8, "sha256": hashlib.sha256(b"the spec").hexdigest()}
    ]

    status, run, _ = await api.call(
        "POST",
        "/api/v1/runs",
        json={"workflow": HELLO, "attachments": {"spec": staged["upload_id"]}},
        headers={"Idempotency-Key": "with-attachment"},
    )
    again, retried, _ = await api.call(
        "POST",
        "/api/v1/runs",
        json={"workflow": HELLO, "attachments": {"spec": staged["upload_id"]}},
        headers={"Idempotency-Key": "with-attachment"},
    )

    assert (status, again) == (201, 200) and retried["run_id"] == run["run_id"]
    doc = await api.env.store.get_run(run["run_id"])
    assert [(a.name, a.filename, a.bytes) for a in doc.attachments] == [("spec", "spec.txt", 8)]
    # The API's run lists them as `status --json` does (found by a new-user walkthrough).
    assert [(a["name"], a["bytes"]) for a in run["attachments"]] == [("spec", 8)]


async def test_another_tenants_upload_id_is_upload_not_found_and_launches_nothing(
    api: Api,
) -> None:
    staged = await upload(api, b"tenant a's file")

    status, body, _ = await api.call(
        "POST",
        "/api/v1/runs",
        token=OP_B,
        json={"workflow": HELLO, "attachments": {"spec": staged["upload_id"]}},
    )

    assert status == 404 and body["error"]["code"] == "upload_not_found"
    assert await api.fleet.stream_messages() == 0
    assert await api.env.store.get_staged_upload(staged["upload_id"], "default") is not None


async def test_an_upload_over_the_per_file_limit_is_refused_and_nothing_is_stored(
    api: Api,
) -> None:
    settings = api.env.settings.model_copy(update={"attachment_max_bytes": 16})
    small = dataclasses.replace(api.env, settings=settings)
    async with TestClient(TestServer(create_app(small, TOKENS))) as client:
        resp = await client.post(
            "/api/v1/uploads",
            params={"filename": "big.bin"},
            data=b"x" * 17,
            headers={"Authorization": f"Bearer {OP_A}"},
        )
        body = await resp.json()
        assert resp.status == 400 and body["error"]["code"] == "attachment_too_large"
        assert "16" in body["error"]["message"]
        ok = await client.post(
            "/api/v1/uploads",
            params={"filename": "ok.bin"},
            data=b"x" * 16,
            headers={"Authorization": f"Bearer {OP_A}"},
        )
        assert ok.status == 201
    assert not list((api.fleet.tmp / "blobs").rglob("big.bin"))


async def test_an_upload_filename_with_a_directory_is_refused(api: Api) -> None:
    status, body, _ = await api.call(
        "POST", "/api/v1/uploads", params={"filename": "../etc/passwd"}, data=b"x"
    )
    assert status == 400 and body["error"]["code"] == "invalid_request"


async def test_an_upload_filename_over_255_utf8_bytes_is_refused_like_any_bad_name(
    api: Api,
) -> None:
    """200 'é' are under the 255-character check but 400 bytes, past the filesystem's name
    limit: the typed 400 of a bad file name, not `ENAMETOOLONG` as a 500."""
    status, body, _ = await api.call(
        "POST", "/api/v1/uploads", params={"filename": "é" * 200}, data=b"x"
    )
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert "255" in body["error"]["message"]
    assert (await upload(api, b"x", filename="é" * 127))["files"][0]["filename"] == "é" * 127


ASKS_FILE = """\
name: asks_file
entry: ask
nodes:
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
  - from: ask
    to: show_doc
"""


async def paused_on_a_file_question(api: Api) -> str:
    await api.fleet.start_runner()
    status, run, _ = await api.call("POST", "/api/v1/runs", json={"workflow": ASKS_FILE})
    assert status == 201
    await api.fleet.wait_status(run["run_id"], "paused_waiting_human")
    return str(run["run_id"])


async def test_a_file_answer_is_an_upload_id_and_reaches_the_run(api: Api) -> None:
    run_id = await paused_on_a_file_question(api)
    staged = await upload(api, b"answered by upload\n", filename="doc.txt")

    status, body, _ = await api.call(
        "POST",
        f"/api/v1/runs/{run_id}/resume",
        json={"answers": {"doc": {"upload": staged["upload_id"]}}},
        template="/api/v1/runs/{run_id}/resume",
    )

    assert status == 200, body
    done = await api.fleet.wait_status(run_id, "finished")
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["show_doc"] == "answered by upload"


async def test_a_file_answer_naming_a_server_path_is_refused_not_read(api: Api) -> None:
    """The operations stage a path answer from the local disk (the CLI's `--answer f=@PATH`);
    over HTTP that disk is the server's, so a path must never be taken as a file answer."""
    run_id = await paused_on_a_file_question(api)
    secret = api.fleet.tmp / "server-secret.txt"
    secret.write_text("not for callers")
    path = f"/api/v1/runs/{run_id}/resume"

    for answer in (str(secret), f"@{secret}", {"path": str(secret)}):
        status, body, _ = await api.call(
            "POST", path, json={"answers": {"doc": answer}}, template=RUN_RESUME
        )
        assert status == 422 and body["error"]["code"] == "answers_invalid", answer
    status, body, _ = await api.call(
        "POST", path, json={"answers": {"doc": {"upload": "nope"}}}, template=RUN_RESUME
    )
    assert status == 404 and body["error"]["code"] == "upload_not_found"
    other = await upload(api, b"tenant b's", token=OP_B)
    status, body, _ = await api.call(
        "POST", path, json={"answers": {"doc": {"upload": other["upload_id"]}}}, template=RUN_RESUME
    )
    assert status == 404 and body["error"]["code"] == "upload_not_found"
    assert (await api.env.store.get_run(run_id)).status == "paused_waiting_human"
    assert not list((api.fleet.tmp / "blobs").rglob("server-secret.txt"))
