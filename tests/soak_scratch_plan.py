"""The scratch soak's plan and its report (`tests/soak_scratch.py`): the workflow whose checks
count a lost scratch instead of failing on it, the knobs, and the table with "lost scratches"."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_CHECK = (
    'cd "$RUNFLEET_SCRATCH_DIR" && sha256sum -c --status data.sum 2>/dev/null && echo ok || '
    '{ echo "$(basename "$(dirname "$RUNFLEET_WORKSPACE")") NODE" >> {{ vars.lost }};'
    " echo lost; }"
)
WORKFLOW = f"""\
name: soak_scratch
entry: write
vars:
  mib: {{type: int, default: 4}}
  lost: {{type: string}}
nodes:
  write:
    kind: tool
    run: >-
      cd "$RUNFLEET_SCRATCH_DIR" && head -c {{{{ vars.mib }}}}M /dev/urandom > data.bin &&
      sha256sum data.bin > data.sum && echo written
  ask: {{kind: human, questions: [{{name: go, type: bool}}]}}
  check1: {{kind: tool, run: '{_CHECK.replace("NODE", "check1")}'}}
  ask2: {{kind: human, questions: [{{name: go, type: bool}}]}}
  check2: {{kind: tool, run: '{_CHECK.replace("NODE", "check2")}'}}
edges:
  - {{from: write, to: ask}}
  - {{from: ask, to: check1}}
  - {{from: check1, to: ask2}}
  - {{from: ask2, to: check2}}
"""


@dataclass
class ScratchSoakConfig:
    runs: int = 12
    runners: int = 2
    slots: int = 4
    mib: int = 8
    kill_every: float = 8.0
    bank_kill_p: float = 0.5
    """Probability that a park caught in its bank gets its runner SIGKILLed."""
    restore_kill_p: float = 0.5
    """Probability that a claim caught before its restore gets its runner SIGKILLed."""
    seed: int = 1
    data: Path | None = None
    keep: bool = False
    deadline_s: float = 420.0
    quiet: bool = False


@dataclass
class ScratchReport:
    config: dict[str, Any]
    runs: int = 0
    finished: int = 0
    kills_random: int = 0
    kills_bank: int = 0
    kills_restore: int = 0
    banked: int = 0
    restored: int = 0
    refused_surface: int = 0
    refused_admission: int = 0
    lost_scratches: int = 0
    wall_s: float = 0.0
    data_dir: str = ""
    violations: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("runs", str(self.runs)),
            ("finished, both checks byte for byte", str(self.finished)),
            (
                "runner SIGKILLs: mid-node / during bank / during restore",
                f"{self.kills_random} / {self.kills_bank} / {self.kills_restore}",
            ),
            ("banks (sandbox_scratch_banked, banked)", str(self.banked)),
            ("restores (sandbox_scratch_restored, restored)", str(self.restored)),
            (
                "refused SCRATCH_NOT_PORTABLE: surface / admission",
                f"{self.refused_surface} / {self.refused_admission}",
            ),
            ("lost scratches", str(self.lost_scratches)),
            ("wall time", f"{self.wall_s:.1f}s"),
            ("violations", str(len(self.violations))),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        return "\n".join(lines + [f"| {k:<{width}} | {v} |" for k, v in rows])
