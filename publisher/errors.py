"""Publisher errors (the rest of the tree is in `store.errors`)."""

from __future__ import annotations

from store import Refusal, RunfleetError


class NatsUnavailable(RunfleetError):
    """NATS cannot be reached (CLI exit code 4)."""

    code = "nats_unavailable"
    remedy = "start the fleet (`runfleet up`) or set RUNFLEET_NATS_URL to a reachable server"


class PublishFailed(RunfleetError):
    """A publish failed after its bounded retries; the run was put back (or failed)."""

    code = "publish_failed"
    remedy = "check NATS, then retry the command"


class DuplicatePublication(RunfleetError):
    """JetStream called a first publish of an attempt a duplicate: that id was already used."""

    code = "duplicate_publication"


class StreamConfigConflict(RunfleetError):
    code = "stream_config_conflict"
    remedy = "JetStream cannot change this in place: migrate the stream by hand, then re-run"


class MalformedMessage(RunfleetError):
    code = "malformed"


class UnsupportedSchema(RunfleetError):
    code = "unsupported_schema"


class RunNotCancellable(Refusal):
    code = "run_not_cancellable"
    remedy = "only queued, running, paused or failed_resumable runs can be cancelled"


class StaleRecord(Refusal):
    code = "stale_record"
    remedy = "the run moved on since this record was written: purge it, or resume the run"


class RecordNotReplayable(Refusal):
    code = "record_not_replayable"
    remedy = "a record with no run to resume can only be purged (`runfleet dlq purge ID`)"


class RecordNotFound(Refusal):
    code = "record_not_found"
    remedy = "list records with `runfleet dlq list`"
