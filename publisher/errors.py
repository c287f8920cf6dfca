"""The publisher's errors; the whole tree, with every code, is drawn in `store.errors`."""

from __future__ import annotations

from store import Refusal, RunfleetError


class NatsUnavailable(RunfleetError, code="nats_unavailable"):
    """NATS cannot be reached (CLI exit code 4)."""

    remedy = "start the fleet (`runfleet up`) or set RUNFLEET_NATS_URL to a reachable server"


class NatsTimeout(NatsUnavailable, code="nats_timeout"):
    """A NATS request got no answer in time (CLI exit code 4)."""

    remedy = (
        "check that NATS is up and not overloaded, and that its JetStream directory's disk is"
        " not full (its log says `no space left on device`; once space is freed, restart the"
        " server: under `runfleet up`, kill its nats-server and `up` starts it again), then"
        " retry"
    )


class JetStreamUnavailable(NatsUnavailable, code="jetstream_unavailable"):
    """The server answers but JetStream does not: not enabled, or not ready yet (exit 4)."""

    remedy = (
        "wait a few seconds and retry (a leader election, a server starting); on a NATS"
        " cluster, bring back enough servers for a majority (two of three); a server of your"
        " own must run with JetStream enabled (`nats-server -js`)"
    )


class StreamNotFound(NatsUnavailable, code="stream_not_found"):
    """A stream or consumer of the wire contract (SPEC §3) is missing (exit 4): nothing can be
    queued or read until it exists again."""

    remedy = "create the streams and consumers with `runfleet streams ensure`, then retry"


class NatsRequestFailed(RunfleetError, code="nats_request_failed"):
    """JetStream refused a request for a reason not listed above (exit 1)."""

    remedy = "read the message and the NATS server's log"


class PublishFailed(RunfleetError, code="publish_failed"):
    """A publish failed after its bounded retries; the run was put back (or failed)."""

    remedy = "check NATS, then retry the command"


class DuplicatePublication(RunfleetError, code="duplicate_publication"):
    """JetStream called a first publish of an attempt a duplicate: that id was already used."""


class StreamConfigConflict(RunfleetError, code="stream_config_conflict"):
    """A stream or consumer that exists with settings the contract cannot take in place."""

    remedy = "JetStream cannot change this in place: migrate the stream by hand, then re-run"


class MalformedMessage(RunfleetError, code="malformed"):
    """A queue message that does not parse as the wire contract (SPEC §3)."""


class UnsupportedSchema(RunfleetError, code="unsupported_schema"):
    """A queue message of a schema version newer than this build reads."""


class RunNotCancellable(Refusal, code="run_not_cancellable"):
    """The run is in a status that a cancel cannot leave."""

    remedy = "only queued, running, paused or failed_resumable runs can be cancelled"


class StaleRecord(Refusal, code="stale_record"):
    """A DLQ record for an attempt the run has moved past."""

    remedy = "the run moved on since this record was written: purge it, or resume the run"


class RecordNotReplayable(Refusal, code="record_not_replayable"):
    """A DLQ record that has no run to resume, or whose message was refused for itself."""

    remedy = "purge it (`runfleet dlq purge ID`)"


class RecordNotFound(Refusal, code="record_not_found"):
    """No DLQ record with that id."""

    remedy = "list records with `runfleet dlq list`"


class ResumeTooLarge(Refusal, code="resume_too_large"):
    """A resume whose message (its answers, mostly) is larger than the NATS server takes in
    one message: refused before anything is written, since no retry could ever send it (an
    API walkthrough met a 503 `publish_failed` for a 1 MB answer, and each retry raised the
    run's attempt)."""

    remedy = (
        "send a large answer as a file (a `file` question, through an upload), or raise the"
        " server's max_payload"
    )


class ConsumerMismatch(RunfleetError, code="consumer_mismatch"):
    """The runners' durable consumer contradicts the settings of the process that checked it
    (SPEC §3): a usage error (exit 2), since restarting cannot mend it, only the settings can."""

    remedy = (
        "run with the RUNFLEET_* values the fleet's runners use (a `runfleet up` fleet shares its"
        " own with every command that finds it through RUNFLEET_DATA); to change the fleet on"
        " purpose, run `runfleet streams ensure` with the new values, then restart every runner"
        " with them"
    )
