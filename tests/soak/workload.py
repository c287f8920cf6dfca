"""The runs' traffic, from the user's and the operator's side: `Workload` launches the runs
(each with an attachment, at most `concurrency` in flight), answers their human pauses (the
publisher's resume, every `cli_resume_every`th through `runfleet resume`), and replays from the
DLQ a run parked `DLQ_PARKED` because chaos spent its whole delivery budget. Its own module
because this is the load the faults break and the verdict judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

from engine.attachments import AttachmentLimits, promote_for_launch
from engine.local import new_run_id
from engine.resume import ResumeRequest
from store import RunDocument, RunfleetError, RunStatus, StoreError
from store.staging import StagingStore
from tests.soak.config import TENANT
from tests.soak.fleet import Fleet
from tests.soak.reads import _events, _list


class Workload(Fleet):
    """Launches, answers and replays."""

    async def launcher(self) -> None:
        assert self.publisher is not None
        hold = min(max(2, self.cfg.concurrency // 2), max(self.cfg.runs // 4, 1))
        while len(self.launched) < self.cfg.runs:
            inflight = len(self.launched) - self.finished
            tail = len(self.launched) >= self.cfg.runs - hold and not self.chaos_done.is_set()
            if inflight >= self.cfg.concurrency or tail or self.nats_down:
                await asyncio.sleep(0.1)
                continue
            run_id = new_run_id()
            inputs = {
                "ledger": str(self.ledger),
                "done": str(self.done),
                "work_s": round(self.rng.uniform(1.0, 3.0), 2),
            }
            try:
                assert self.blobs is not None
                files = await promote_for_launch(
                    StagingStore(self.publisher.store, self.blobs),
                    self.blobs,
                    TENANT,
                    run_id,
                    paths={"seed": self.seed_file},
                    uploads={},
                    limits=AttachmentLimits(),
                )
                await self.publisher.launch(
                    self.loaded, inputs, tenant=TENANT, run_id=run_id, attachments=files
                )
            except (RunfleetError, OSError) as exc:
                # The caller was told. A launch whose publish failed ends `failed
                # LAUNCH_FAILED` (SPEC §4): not a run to finish, launch another. A run that
                # exists otherwise (e.g. the error came after the create) must still finish.
                self.say(f"launch of {run_id} raised: {exc!r}")
                await asyncio.sleep(0.5)
                with contextlib.suppress(RunfleetError):
                    doc = await self.publisher.store.get_run(run_id)
                    if doc.failure_code == "LAUNCH_FAILED":
                        self.refused.append(run_id)
                    else:
                        self.launched.append(run_id)
                        self.progressed.set()
                continue
            self.launched.append(run_id)
            self.progressed.set()

    async def resumer(self) -> None:
        assert self.reader is not None
        count = 0
        while not self.stop.is_set():
            try:
                counts = await self.reader.status_counts(TENANT)
                paused = await _list(self.reader, [RunStatus.PAUSED_WAITING_HUMAN])
                failed = await _list(self.reader, [RunStatus.FAILED_RESUMABLE])
            except StoreError:
                await asyncio.sleep(0.5)
                continue
            finished = counts.get(RunStatus.FINISHED, 0)
            if finished != self.finished:
                self.finished = finished
                self.progressed.set()
            for run in failed:
                if run.failure_code == "DLQ_PARKED" and run.run_id not in self.resuming:
                    self.resuming.add(run.run_id)
                    self.tasks.append(asyncio.create_task(self.replay(run)))
            for run in paused:
                if run.run_id in self.resuming:
                    continue
                count += 1
                via_cli = self.cfg.cli_resume_every > 0 and count % self.cfg.cli_resume_every == 0
                self.resuming.add(run.run_id)
                self.tasks.append(asyncio.create_task(self.resume(run.run_id, via_cli)))
            await asyncio.sleep(0.3)

    async def resume(self, run_id: str, via_cli: bool) -> None:
        assert self.publisher is not None
        try:
            if via_cli:
                done = await asyncio.to_thread(
                    subprocess.run,
                    [
                        sys.executable,
                        "-m",
                        "runner",
                        "resume",
                        run_id,
                        "--answer",
                        "approved=yes",
                        "--json",
                    ],
                    env=self.env(),
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
                ok = done.returncode == 0
                if not ok:
                    self.say(
                        f"runfleet resume {run_id} exit {done.returncode}: "
                        f"{done.stdout.decode()[-300:]} {done.stderr.decode()[-300:]}"
                    )
            else:
                try:
                    await self.publisher.resume(
                        run_id, ResumeRequest(cli_answers={"approved": "yes"}), tenant=TENANT
                    )
                    ok = True
                except RunfleetError as exc:
                    self.say(f"resume {run_id} refused: {exc!r}")
                    ok = False
            if ok:
                self.report.resumes += 1
                self.report.resumes_cli += via_cli
            else:
                self.report.resume_retries += 1
                await asyncio.sleep(1.0)
        finally:
            self.resuming.discard(run_id)

    async def replay(self, run: RunDocument) -> None:
        """What an operator does with a run parked `DLQ_PARKED` (§5.6): replay its record.
        Under this much chaos a message can spend its whole delivery budget on executions that
        were each interrupted; the verdict checks that every one of them was."""
        assert self.publisher is not None and self.store is not None
        try:
            events = await _events(self.store, run.run_id)
            parks = [e for e in events if e.type == "run_dlq_parked" and e.attempt == run.attempt]
            if not parks:
                return  # the event follows the park: judged again on the next pass
            said = parks[-1].data.get("record_id")
            if said is None:  # a repaired event (`runner.repair`) names no record: look it up
                assert self.dlq is not None
                records = [
                    r
                    for r in await self.dlq.list()
                    if r.run_id == run.run_id and r.attempt == run.attempt
                ]
                if not records:
                    return  # judged again on the next pass
                said = records[-1].id
            record_id = int(said)
            self.say(f"run {run.run_id} parked DLQ_PARKED (record {record_id}); replaying it")
            await self.publisher.replay(record_id, tenant=TENANT)
            self.parked[run.run_id].append((run.attempt, record_id))
            self.report.replays += 1
        except (RunfleetError, OSError) as exc:
            self.say(f"replay of {run.run_id} failed: {exc!r}")
            await asyncio.sleep(1.0)
        finally:
            self.resuming.discard(run.run_id)
