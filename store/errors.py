"""The one exception tree of runfleet.

Every error a caller can act on is a `RunfleetError` with a stable, machine-readable `code`
(snake_case, part of the CLI's `--json` contract) and, where one exists, a `remedy` a person can
follow. Errors from drivers (sqlite3, pymongo, botocore, nats) are translated into this tree at
the module that calls the driver, so nothing above `store/` ever catches a driver's exception.

The whole tree, with each class's `code` (a test keeps this drawing true). Every package keeps
its errors in its own `errors.py` (a few live beside the one module that raises them):

    RunfleetError                               runfleet_error
    ├── StoreError                              store_error
    │   ├── StoreUnavailable                    store_unavailable
    │   ├── StoreCorrupt                        store_corrupt
    │   ├── InvalidStoreUrl                     invalid_store_url
    │   ├── DocumentInvalid                     document_invalid
    │   ├── RunAlreadyExists                    run_exists
    │   ├── UploadAlreadyExists                 upload_exists
    │   ├── IllegalTransition                   illegal_transition
    │   ├── UnwritablePath                      unwritable_path
    │   ├── BlobNotFound                        blob_not_found
    │   └── BlobKeyInvalid                      blob_key_invalid
    ├── WorkflowInvalid                         workflow_invalid
    ├── ExpressionError                         expression_failed
    ├── TemplateError                           template_failed
    ├── LeaseLost                               lease_lost
    ├── UnknownSandboxDriver                    unknown_sandbox_driver
    ├── KubernetesSettingsInvalid               kubernetes_settings_invalid
    │   └── PodTemplateInvalid                  pod_template_invalid
    ├── SandboxError                            sandbox_error
    │   ├── SandboxStartFailed                  sandbox_start_failed
    │   ├── SandboxAccessDenied                 sandbox_access_denied
    │   ├── SandboxSetupTimeout                 sandbox_setup_timeout
    │   ├── SandboxCapacity                     sandbox_capacity
    │   ├── SandboxImageInvalid                 sandbox_image_invalid
    │   ├── SandboxLost                         sandbox_lost
    │   ├── SandboxRecordCorrupt                sandbox_record_corrupt
    │   ├── SandboxExecFailed                   sandbox_exec_failed
    │   ├── SandboxCopyFailed                   sandbox_copy_failed
    │   │   ├── SandboxCopyTooLarge             sandbox_copy_too_large
    │   │   └── SandboxArchiveInvalid           sandbox_archive_invalid
    │   ├── AttachmentsUnfetchable              attachments_unfetchable
    │   ├── AttachmentsUndeliverable            attachments_undeliverable
    │   └── AttachmentPathUnavailable           attachment_path_unavailable
    ├── LaunchFailed                            launch_failed
    ├── ArchiveError                            archive_error
    │   ├── ArchiveOverCap                      archive_over_cap
    │   ├── ArchiveOverBound                    archive_over_bound
    │   ├── ArchiveStopped                      archive_stopped
    │   └── ArchiveRefused                      archive_refused
    ├── NatsUnavailable                         nats_unavailable          (CLI exit code 4)
    │   ├── NatsTimeout                         nats_timeout
    │   ├── JetStreamUnavailable                jetstream_unavailable
    │   └── StreamNotFound                      stream_not_found
    ├── NatsRequestFailed                       nats_request_failed
    │   └── PullRefused                         pull_refused
    ├── PublishFailed                           publish_failed
    ├── DuplicatePublication                    duplicate_publication
    ├── StreamConfigConflict                    stream_config_conflict
    ├── MalformedMessage                        malformed
    ├── UnsupportedSchema                       unsupported_schema
    ├── ConsumerMismatch                        consumer_mismatch
    ├── SettingsInvalid                         settings_invalid          (CLI exit code 2)
    └── Refusal                                 refused                   (CLI exit code 3)
        ├── RunNotFound                         run_not_found
        ├── AnswersRequired                     answers_required
        ├── AnswersInvalid                      answers_invalid
        ├── VarsInvalid                         vars_invalid
        ├── RunNotResumable                     run_not_resumable
        ├── ScratchNotPortable                  scratch_not_portable
        ├── WorkflowSourceChanged               workflow_source_changed
        ├── SourceLacksRestartNode              source_lacks_restart_node
        ├── BudgetBelowConsumed                 budget_below_consumed
        ├── RunBusy                             run_busy
        ├── RewindRefused                       rewind_refused
        ├── RunNotCancellable                   run_not_cancellable
        ├── StaleRecord                         stale_record
        ├── RecordNotReplayable                 record_not_replayable
        ├── RunIdAmbiguous                      run_id_ambiguous
        ├── FleetAlreadyRunning                 fleet_already_running
        ├── NotConfirmed                        not_confirmed
        ├── IdempotencyKeyReused                idempotency_key_reused
        ├── AttachmentNameInvalid               attachment_name_invalid
        ├── AttachmentTooLarge                  attachment_too_large
        ├── TooManyAttachments                  too_many_attachments
        ├── StagedUploadNotFound                upload_not_found
        ├── StagedUploadInvalid                 upload_invalid
        ├── StagedUploadInUse                   upload_in_use
        ├── RecordNotFound                      record_not_found
        └── ResumeTooLarge                      resume_too_large

`store` is drawn first, then `engine` (`errors`, `fencing`, `sandbox.errors`, `archive`, `vars`,
`refusals`), then `publisher`, then `runner`; `StoreUnavailable` and the `NatsUnavailable`
family are what the CLI calls unreachable (exit code 4).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

_CODE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
_CODES: dict[str, str] = {}
"""code → the class that owns it (`module.QualName`); a second owner is refused."""


class RunfleetError(Exception):
    """Root of every error runfleet raises on purpose.

    An error class is declared, not programmed: its `code` goes in the class header, a remedy
    that does not depend on the case is a class attribute, and the message is the one argument
    (or is built by a one-line `__init__` from the facts the class keeps):

        class StoreCorrupt(StoreError, code="store_corrupt"):
            remedy = "restore the file from a backup or point RUNFLEET_STORE_URL at ..."

    Each class states its own code, in snake_case, and no two classes share one; all three are
    checked when the class is created, so a slip fails at import rather than as a wrong
    `code` in a user's `--json` output (a class that forgot would answer with its parent's).
    """

    code: ClassVar[str] = "runfleet_error"
    remedy: str | None = None

    def __init_subclass__(cls, *, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        elif "code" not in cls.__dict__:
            raise TypeError(
                f'{cls.__qualname__} states no code: class {cls.__name__}(..., code="...")'
            )
        owner = f"{cls.__module__}.{cls.__qualname__}"
        if not _CODE.fullmatch(cls.code):
            raise TypeError(f"{owner}: code {cls.code!r} is not snake_case")
        if _CODES.setdefault(cls.code, owner) != owner:
            raise TypeError(f"{owner}: code {cls.code!r} is already {_CODES[cls.code]}'s")

    def __init__(self, message: str, *, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy

    def to_dict(self) -> dict[str, object]:
        """The `{"code", "message", "remedy"}` shape the CLI prints with `--json`."""
        out: dict[str, object] = {"code": self.code, "message": self.message}
        if self.remedy:
            out["remedy"] = self.remedy
        return out


class Refusal(RunfleetError, code="refused"):
    """An operation the caller may not do in the current state (CLI exit code 3)."""


class StoreError(RunfleetError, code="store_error"):
    """The store or the blob store misbehaved."""


class StoreUnavailable(StoreError, code="store_unavailable"):
    """The backend cannot be reached or timed out. Transient: callers retry or nak."""

    remedy = "check that the store is running and reachable, then retry"


class StoreCorrupt(StoreError, code="store_corrupt"):
    """A file or document is not what we wrote."""

    remedy = "restore the file from a backup or point RUNFLEET_STORE_URL at a healthy store"


class InvalidStoreUrl(StoreError, code="invalid_store_url"):
    """The URL names no backend we can open."""

    remedy = "use sqlite:///path, mongodb://host/db, file:///path or s3://bucket/prefix"


class DocumentInvalid(StoreError, code="document_invalid"):
    """A stored record does not validate; it is reported, never silently rewritten."""

    remedy = "inspect the record; runfleet never rewrites an invalid record by itself"


class RunAlreadyExists(StoreError, code="run_exists"):
    """A create-only write met an existing id."""


class UploadAlreadyExists(StoreError, code="upload_exists"):
    """A staged upload's record met an existing id: the same typed error on every store."""


class RunNotFound(Refusal, code="run_not_found"):
    """No run with that id."""

    remedy = "check the run id with `runfleet runs`"


class IllegalTransition(StoreError, code="illegal_transition"):
    """A compare-and-set asked for a status change the status table does not allow.

    This is a programming error in the caller, not a race: a race is a `CasConflict` result.
    """


class UnwritablePath(StoreError, code="unwritable_path"):
    """A write whose paths the stored document cannot take: a dotted path under a parent that
    is null or not a sub-document, or two paths of one write that overlap.

    A real `mongod` refuses both ("Cannot create field 'b' in element {a: null}", "would create
    a conflict"), while mongomock drops or merges them silently and a plain dict walk would
    overwrite the parent. Every backend refuses them alike, so a caller that writes under a
    possibly-null parent fails in the conformance suite instead of on a production server. A
    programming error in the caller (write the whole parent object instead), not a race.
    """


class BlobNotFound(StoreError, code="blob_not_found"):
    """No blob under that key."""


class BlobKeyInvalid(StoreError, code="blob_key_invalid"):
    """A key that escapes the store's prefix."""

    remedy = "blob keys are relative paths like runs/<id>/scratch/<token>.tgz, without '..'"
