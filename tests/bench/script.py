"""Running one `bench` script as a user would: `python -m bench.<script> ARGS` from the repo."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """Both streams, for an assertion's message."""
        return f"stdout:\n{self.stdout}\nstderr:\n{self.stderr[-4000:]}"

    @property
    def summaries(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith("SUMMARY ")]


def run_bench(script: str, *args: str, timeout: float = 100) -> ScriptRun:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return ScriptRun(proc.returncode, proc.stdout, proc.stderr)
