"""Runs the CLI in a child process that reports, as it exits, how many objects it froze out of
the garbage collector (ADR-0016): the only way to see from outside that a process did."""

from __future__ import annotations

import re
import sys

CLI_REPORTING_FROZEN = (
    sys.executable,
    "-c",
    "import atexit, gc, sys;"
    " atexit.register(lambda: print(f'gc frozen: {gc.get_freeze_count()}', file=sys.stderr));"
    " from runner.cli.main import cli; cli()",
)
"""Prefix for a `runfleet ...` argv; the child prints `gc frozen: N` to stderr at exit."""


def frozen_at_exit(output: str) -> int:
    """The `N` a child started with `CLI_REPORTING_FROZEN` printed as it exited."""
    found = re.search(r"gc frozen: (\d+)", output)
    assert found is not None, f"no freeze count reported at exit:\n{output}"
    return int(found.group(1))
