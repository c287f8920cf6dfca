"""Interactions, staged-upload records and locks on MongoDB: projections and side records
beside the run document (SPEC §8, §9), each one document per operation."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pymongo import ASCENDING
from pymongo.errors import DuplicateKeyError

from store.cas import to_storage
from store.codec import decode, encode
from store.errors import UploadAlreadyExists
from store.models import Interaction, InteractionStatus, LockRecord, StagedUpload
from store.mongo.connection import Doc, MongoConnection
from store.timeutil import to_ms

_PENDING = InteractionStatus.PENDING.value


class MongoRecords(MongoConnection):
    # -- interactions -----------------------------------------------------------------------

    def _interaction(self, raw: Doc) -> Interaction:
        return decode(Interaction, raw, what="interaction", ident=str(raw.get("_id")))

    async def put_interaction(self, interaction: Interaction) -> Interaction:
        doc = {**encode(interaction), "_id": interaction.id}
        if await self._insert("put interaction", self._interactions, doc):
            return interaction
        raw = await self._io("get interaction", self._interactions.find_one, {"_id": doc["_id"]})
        if raw is None:  # deleted between our insert and this read (`gc`): it was there
            return interaction
        return self._interaction(raw)

    async def answer_interaction(
        self, interaction_id: str, answers: dict[str, Any], at: datetime
    ) -> Interaction | None:
        sets = {
            "status": InteractionStatus.ANSWERED.value,
            "answers": to_storage(answers),
            "answered_at": to_ms(at),
        }
        flt = {"_id": interaction_id, "status": _PENDING}
        raw, retried = await self._find_one_and_update(
            "answer interaction", self._interactions, flt, {"$set": sets}
        )
        if raw is None and retried:  # our first attempt may have landed
            raw = await self._io("re-read", self._interactions.find_one, {"_id": interaction_id})
            if raw is None or any(raw.get(k) != v for k, v in sets.items()):
                return None
        return None if raw is None else self._interaction(raw)

    async def retire_interactions(self, run_id: str) -> int:
        """One `update_one` per interaction (no `update_many` in the mongomock-served subset)."""
        pending = await self._find(
            "list pending", self._interactions, {"run_id": run_id, "status": _PENDING}, []
        )
        retired = 0
        for raw in pending:
            result = await self._io(
                "retire interaction",
                self._interactions.update_one,
                {"_id": raw["_id"], "status": _PENDING},
                {"$set": {"status": InteractionStatus.RETIRED.value}},
            )
            retired += result.modified_count
        return retired

    async def list_interactions(
        self, run_id: str, *, pending_only: bool = False
    ) -> list[Interaction]:
        flt: Doc = {"run_id": run_id, **({"status": _PENDING} if pending_only else {})}
        order = [("created_at", ASCENDING), ("_id", ASCENDING)]
        raws = await self._find("list interactions", self._interactions, flt, order)
        return [self._interaction(raw) for raw in raws]

    # -- staged uploads ---------------------------------------------------------------------

    def _staged_upload(self, raw: Doc) -> StagedUpload:
        return decode(StagedUpload, raw, what="staged upload", ident=str(raw.get("_id")))

    async def put_staged_upload(self, record: StagedUpload) -> None:
        doc = {**encode(record), "_id": record.id}
        if not await self._insert("put staged upload", self._staged, doc):
            raise UploadAlreadyExists(f"staged upload {record.id!r} already exists")

    async def get_staged_upload(self, upload_id: str, tenant: str) -> StagedUpload | None:
        flt = {"_id": upload_id, "tenant": tenant}
        raw = await self._io("get staged upload", self._staged.find_one, flt)
        return None if raw is None else self._staged_upload(raw)

    async def delete_staged_upload(self, upload_id: str, tenant: str) -> bool:
        flt = {"_id": upload_id, "tenant": tenant}
        result = await self._io("delete staged upload", self._staged.delete_one, flt)
        return result.deleted_count > 0

    async def claim_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        # `None` matches a missing field too: records staged before claims existed.
        flt = {"_id": upload_id, "tenant": tenant, "claimed_by": {"$in": [None, claimant]}}
        update = {"$set": {"claimed_by": claimant}}
        result = await self._io("claim staged upload", self._staged.update_one, flt, update)
        return result.matched_count > 0

    async def release_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        flt = {"_id": upload_id, "tenant": tenant, "claimed_by": claimant}
        update = {"$set": {"claimed_by": None}}
        result = await self._io("release staged upload", self._staged.update_one, flt, update)
        return result.matched_count > 0

    async def list_staged_uploads_before(
        self, cutoff: datetime, limit: int = 100
    ) -> list[StagedUpload]:
        flt = {"created_at": {"$lt": to_ms(cutoff)}}
        order = [("created_at", ASCENDING), ("_id", ASCENDING)]
        raws = await self._find("list staged uploads", self._staged, flt, order, limit)
        return [self._staged_upload(raw) for raw in raws]

    # -- locks ------------------------------------------------------------------------------

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        """One upsert: it matches only a lock that is ours or expired; when the lock exists and
        is held by another, the upsert's insert collides on `_id` and that is the refusal."""
        now_ms = to_ms(now)
        record = LockRecord(name=name, owner=owner, expires_at=now + timedelta(seconds=ttl_s))
        flt = {"_id": name, "$or": [{"owner": owner}, {"expires_at": {"$lte": now_ms}}]}
        try:
            await self._find_one_and_update(
                "take lock", self._locks, flt, {"$set": encode(record)}, upsert=True
            )
        except DuplicateKeyError:
            return False
        return True
