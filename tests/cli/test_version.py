"""`--version` tells builds apart (docs/reliability.md O31's leftover: every build said 0.1.0,
so an operator mid-upgrade could not tell which build a process ran)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from click.testing import CliRunner

from runner.build import PACKAGES, describe, git_commit, source_digest, version
from runner.cli.main import cli
from runner.metrics import RunnerMetrics

ROOT = Path(__file__).resolve().parents[2]


def copy_sources(to: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, to / package, ignore=shutil.ignore_patterns("__pycache__"))
    return to


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def test_the_build_digest_is_the_same_for_the_same_sources_wherever_they_are(
    tmp_path: Path,
) -> None:
    a = copy_sources(tmp_path / "a")
    b = copy_sources(tmp_path / "b")
    assert source_digest.__wrapped__(a) == source_digest.__wrapped__(b)
    assert source_digest.__wrapped__(a) == source_digest()


def test_the_build_digest_changes_with_any_source_change(tmp_path: Path) -> None:
    root = copy_sources(tmp_path / "src")
    before = source_digest.__wrapped__(root)
    (root / "runner" / "claim.py").write_text((root / "runner" / "claim.py").read_text() + "\n")
    changed = source_digest.__wrapped__(root)
    assert changed != before
    (root / "store" / "new_module.py").write_text("")
    assert source_digest.__wrapped__(root) != changed


def test_the_commit_is_read_from_a_checkout_loose_packed_or_detached(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    assert git_commit(repo) is None  # not a checkout: an installed wheel
    git(repo, "init", "-q")
    (repo / "f").write_text("x")
    git(repo, "add", "f")
    git(repo, "commit", "-qm", "one")
    head = git(repo, "rev-parse", "HEAD")
    assert git_commit(repo) == head[:12]
    git(repo, "pack-refs", "--all")
    assert git_commit(repo) == head[:12]
    git(repo, "checkout", "-q", "--detach")
    assert git_commit(repo) == head[:12]
    worktree = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(worktree), "-b", "other")
    assert git_commit(worktree) == head[:12]


def test_version_prints_the_release_the_build_and_the_commit() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    assert line == f"runfleet, version {describe()}"
    assert f"build {source_digest()}" in line
    commit = git_commit()
    if (ROOT / ".git").exists():
        assert commit is not None and f"commit {commit}" in line
    assert line.startswith(f"runfleet, version {version()} (")


def test_the_build_info_metric_carries_the_build() -> None:
    registry = RunnerMetrics().registry
    value = registry.get_sample_value(
        "runfleet_build_info", {"version": version(), "build": source_digest()}
    )
    assert value == 1.0
