"""Blob keys: the one rule both blob stores apply before touching a file or a bucket.

A key is a relative, '/'-separated path (`runs/<id>/scratch/<token>.tgz`). Anything that could
name a different place on one backend than on the other is refused with `BlobKeyInvalid`: a
leading '/', '..' or '.' segments, empty segments ('a//b', a trailing '/'), backslashes (a
separator on Windows, a literal on S3) and NUL (which truncates a path in C).
"""

from __future__ import annotations

from store.errors import BlobKeyInvalid

_FORBIDDEN_SEGMENTS = frozenset({"", ".", ".."})


def validate_key(key: str) -> str:
    """Return `key` unchanged if it is a valid blob key, else raise `BlobKeyInvalid` naming it."""
    if not isinstance(key, str) or not key:
        raise BlobKeyInvalid(f"blob key {key!r} is empty")
    reason = _problem(key)
    if reason is not None:
        raise BlobKeyInvalid(f"blob key {key!r} is invalid: {reason}")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key with an optional trailing '/' (`runs/<id>/`).

    A prefix may end mid-segment (`uploads/ab`): listing matches on the key string, not on
    directories.
    """
    if not isinstance(prefix, str):
        raise BlobKeyInvalid(f"blob prefix {prefix!r} is not a string")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    reason = _problem(body) if body else "it is only '/'"
    if reason is not None:
        raise BlobKeyInvalid(f"blob prefix {prefix!r} is invalid: {reason}")
    return prefix


def _problem(key: str) -> str | None:
    if "\x00" in key:
        return "it contains a NUL character"
    if "\\" in key:
        return "it contains a backslash; use '/' as the separator"
    if key.startswith("/"):
        return "it is absolute; keys are relative"
    for segment in key.split("/"):
        if segment in _FORBIDDEN_SEGMENTS:
            return "it has an empty, '.' or '..' segment"
    return None


RESERVED_PREFIX = ".rf-tmp-"
"""The filesystem blob store's temporary files start with it (`store.blobs_fs.TEMP_PREFIX`):
a name given by a user never does, on any store (a file `.rf-tmp-a` was a 500 on one store
and fine on another; found by a review)."""

SEGMENT_MAX_BYTES = 255
"""The longest segment, in UTF-8 bytes: the file-name limit of the common filesystems (ext4,
XFS, APFS), so a segment can always be a file (200 'é' are 200 characters but 400 bytes)."""


def validate_segment(segment: str, *, what: str) -> str:
    """One path segment (a file or attachment name): a valid key without '/', of at most
    `SEGMENT_MAX_BYTES` bytes in UTF-8."""
    if not isinstance(segment, str) or not segment or "/" in segment or _problem(segment):
        raise BlobKeyInvalid(
            f"{what} {segment!r} is invalid: it must be one non-empty path segment, "
            "without '/', '\\', NUL, and not '.' or '..'"
        )
    try:
        segment.encode("utf-8")
    except UnicodeEncodeError:
        # A file name of bytes that are not UTF-8 (read with surrogateescape): no key holds
        # it; an untyped validation error reached the user (found by a review).
        raise BlobKeyInvalid(
            f"{what} {segment.encode('utf-8', 'backslashreplace').decode()[:60]!r} is not"
            " UTF-8: rename the file"
        ) from None
    if segment.startswith(RESERVED_PREFIX):
        raise BlobKeyInvalid(
            f"{what} {segment[:40]!r} starts with {RESERVED_PREFIX!r}, which the blob stores"
            " keep for their own temporary files: rename the file"
        )
    if len(segment.encode("utf-8", "surrogatepass")) > SEGMENT_MAX_BYTES:
        raise BlobKeyInvalid(
            f"{what} {segment[:40]!r}… is invalid: longer than {SEGMENT_MAX_BYTES} bytes in UTF-8"
        )
    return segment
