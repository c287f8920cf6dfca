"""The MongoDB `RunStore` (SPEC §9, ADR-0002, ADR-0008), by concept: `runs` (the documents and
their compare-and-set, and the assembled `MongoRunStore`), `events`, `records` (interactions,
staged uploads, locks), `connection` (retries, error translation, indexes)."""

from store.mongo.connection import redact_url
from store.mongo.runs import MongoRunStore

__all__ = ["MongoRunStore", "redact_url"]
