"""Interactions, staged-upload records and locks on SQLite: projections and side records beside
the run document (SPEC §8, §9), each one statement or one transaction."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from store.codec import decode, encode
from store.errors import UploadAlreadyExists
from store.models import Interaction, InteractionStatus, StagedUpload
from store.sqlite.connection import SqliteConnection
from store.sqlite.schema import dumps, loads
from store.timeutil import to_ms


def _interaction(text: str, ident: str) -> Interaction:
    return decode(Interaction, loads(text, "interaction", ident), what="interaction", ident=ident)


def _staged_upload(text: str, ident: str) -> StagedUpload:
    raw = loads(text, "staged upload", ident)
    return decode(StagedUpload, raw, what="staged upload", ident=ident)


class SqliteRecords(SqliteConnection):
    # -- interactions -------------------------------------------------------------------------

    async def put_interaction(self, interaction: Interaction) -> Interaction:
        def put(conn: sqlite3.Connection) -> str:
            conn.execute(
                "INSERT OR IGNORE INTO interactions (id, run_id, status, doc) VALUES (?, ?, ?, ?)",
                (
                    interaction.id,
                    interaction.run_id,
                    str(interaction.status),
                    dumps(encode(interaction)),
                ),
            )
            row = conn.execute(
                "SELECT doc FROM interactions WHERE id = ?", (interaction.id,)
            ).fetchone()
            return str(row[0])

        return _interaction(await self._write(put), interaction.id)

    async def answer_interaction(
        self, interaction_id: str, answers: dict[str, Any], at: datetime
    ) -> Interaction | None:
        def answer(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT doc FROM interactions WHERE id = ? AND status = ?",
                (interaction_id, InteractionStatus.PENDING.value),
            ).fetchone()
            if row is None:
                return None
            doc = loads(row[0], "interaction", interaction_id)
            doc.update(status="answered", answers=answers, answered_at=to_ms(at))
            conn.execute(
                "UPDATE interactions SET status = 'answered', doc = ? WHERE id = ?",
                (dumps(doc), interaction_id),
            )
            return dumps(doc)

        text = await self._write(answer)
        return None if text is None else _interaction(text, interaction_id)

    async def retire_interactions(self, run_id: str) -> int:
        def retire(conn: sqlite3.Connection) -> int:
            rows = conn.execute(
                "SELECT id, doc FROM interactions WHERE run_id = ? AND status = 'pending'",
                (run_id,),
            ).fetchall()
            for ident, text in rows:
                doc = loads(text, "interaction", ident)
                doc["status"] = "retired"
                conn.execute(
                    "UPDATE interactions SET status = 'retired', doc = ? WHERE id = ?",
                    (dumps(doc), ident),
                )
            return len(rows)

        return await self._write(retire)

    async def list_interactions(
        self, run_id: str, *, pending_only: bool = False
    ) -> list[Interaction]:
        sql = "SELECT id, doc FROM interactions WHERE run_id = ?"
        if pending_only:
            sql += " AND status = 'pending'"
        rows = await self._read(lambda c: c.execute(sql + " ORDER BY id", (run_id,)).fetchall())
        return [_interaction(text, ident) for ident, text in rows]

    # -- staged uploads -----------------------------------------------------------------------

    async def put_staged_upload(self, record: StagedUpload) -> None:
        def put(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO staged_uploads (id, tenant, created_ms, doc) VALUES (?, ?, ?, ?)",
                    (record.id, record.tenant, to_ms(record.created_at), dumps(encode(record))),
                )
            except sqlite3.IntegrityError as exc:
                raise UploadAlreadyExists(f"staged upload {record.id!r} already exists") from exc

        await self._write(put)

    async def get_staged_upload(self, upload_id: str, tenant: str) -> StagedUpload | None:
        row = await self._read(
            lambda c: c.execute(
                "SELECT doc FROM staged_uploads WHERE id = ? AND tenant = ?", (upload_id, tenant)
            ).fetchone()
        )
        return None if row is None else _staged_upload(row[0], upload_id)

    async def delete_staged_upload(self, upload_id: str, tenant: str) -> bool:
        return await self._write(
            lambda c: (
                c.execute(
                    "DELETE FROM staged_uploads WHERE id = ? AND tenant = ?", (upload_id, tenant)
                ).rowcount
                > 0
            )
        )

    async def claim_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        return await self._write(
            lambda c: (
                c.execute(
                    "UPDATE staged_uploads SET doc = json_set(doc, '$.claimed_by', ?)"
                    " WHERE id = ? AND tenant = ?"
                    " AND coalesce(json_extract(doc, '$.claimed_by'), ?) = ?",
                    (claimant, upload_id, tenant, claimant, claimant),
                ).rowcount
                > 0
            )
        )

    async def release_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        return await self._write(
            lambda c: (
                c.execute(
                    "UPDATE staged_uploads SET doc = json_set(doc, '$.claimed_by', json('null'))"
                    " WHERE id = ? AND tenant = ? AND json_extract(doc, '$.claimed_by') = ?",
                    (upload_id, tenant, claimant),
                ).rowcount
                > 0
            )
        )

    async def list_staged_uploads_before(
        self, cutoff: datetime, limit: int = 100
    ) -> list[StagedUpload]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT id, doc FROM staged_uploads WHERE created_ms < ? ORDER BY created_ms"
                " LIMIT ?",
                (to_ms(cutoff), limit),
            ).fetchall()
        )
        return [_staged_upload(d, i) for i, d in rows]

    # -- locks --------------------------------------------------------------------------------

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        now_ms = to_ms(now)
        expires = now_ms + int(ttl_s * 1000)

        def lock(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO locks (name, owner, expires_ms) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,"
                " expires_ms = excluded.expires_ms"
                " WHERE locks.owner = excluded.owner OR locks.expires_ms <= ?",
                (name, owner, expires, now_ms),
            )
            return cur.rowcount > 0

        return await self._write(lock)
