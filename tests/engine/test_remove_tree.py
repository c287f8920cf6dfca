"""A scratch a node made read-only is still emptied by a runner that is not root: a restore
first empties the scratch, and `shutil.rmtree` refused such a directory, so the restore was
retried as transient for good (found by a review of hostile scratches). Run as an unprivileged
user in a child process: root ignores the permission bits this is about."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.scratch import remove_tree

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def _read_only_tree(root: Path) -> Path:
    top = root / "scratch"
    (top / "cache" / "mod").mkdir(parents=True)
    (top / "cache" / "mod" / "go.mod").write_text("module x\n")
    for path in (top, top / "cache", top / "cache" / "mod", top / "cache" / "mod" / "go.mod"):
        os.chown(path, NOBODY, NOBODY)
    for path in (top / "cache" / "mod", top / "cache"):
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)  # `chmod -R a-w`, as a Go module cache is
    root.chmod(0o777)
    return top


def _as_nobody(remove: str, top: Path) -> int:
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, remove, report by exit code
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if remove == "ours":
                remove_tree(top)
            else:
                shutil.rmtree(top)
            code = 0
        except BaseException:  # noqa: BLE001 - the exit code is the report
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory `nobody` can reach (pytest's own tmp dirs are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="runfleet-remove-tree-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        remove_tree(base)


def test_a_scratch_a_node_made_read_only_is_emptied_by_a_runner_that_is_not_root(
    reachable: Path,
) -> None:
    (reachable / "a").mkdir()
    (reachable / "b").mkdir()
    assert _as_nobody("shutil", _read_only_tree(reachable / "a")) == 1  # what it was
    top = _read_only_tree(reachable / "b")
    assert _as_nobody("ours", top) == 0
    assert not top.exists()
