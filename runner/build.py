"""Which build of runfleet this process runs, told apart beyond the package version.

Every build calls itself 0.1.0 (docs/reliability.md O31: an operator upgrading could not tell
the old build from the new with `--version`). The package version stays what pyproject says;
beside it go a digest of the installed sources — the same for the same code however it was
installed (a wheel in an image, an editable checkout), different for any change — and, when
the sources are a git checkout, its commit. Nothing here runs at import: `--version` and a
runner's start pay for the digest (a few milliseconds), no other command does.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import metadata
from pathlib import Path

PACKAGES = ("store", "engine", "publisher", "runner")
"""The top-level packages the runfleet distribution installs (pyproject's `packages`)."""

_ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    try:
        return metadata.version("runfleet")
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def source_digest(root: Path = _ROOT) -> str:
    """12 hex digits of SHA-256 over every `.py` and `.pyi` of the packages, by relative path."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        base = root / package
        files = sorted(p for p in base.rglob("*") if p.suffix in (".py", ".pyi") and p.is_file())
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:12]


def git_commit(root: Path = _ROOT) -> str | None:
    """The checkout's HEAD commit (12 hex digits), read from `.git` without running git; None
    outside a checkout (an installed wheel) or when it cannot be read."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: PATH"
            text = git.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            git = (root / text.removeprefix("gitdir:").strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:12] or None
        ref = head.removeprefix("ref:").strip()
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in (git, common):
            loose = base / ref
            if loose.is_file():
                return loose.read_text().strip()[:12] or None
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha[:12]
    except (OSError, UnicodeDecodeError):
        return None
    return None


def describe() -> str:
    """`0.1.0 (build 3f2a9c1d0e4b, commit 8013fe5a1b2c)`: what `--version` prints."""
    parts = [f"build {source_digest()}"]
    commit = git_commit()
    if commit:
        parts.append(f"commit {commit}")
    return f"{version()} ({', '.join(parts)})"
