"""The soak's workflow and its ledger: every tool node of `WORKFLOW` (prepare -> flaky ->
approve (human) -> work -> finish) appends one line per execution to a ledger (time, run id,
node, execution token), and the final node one more to the completion ledger; `_ledger` reads
them back for the verdict. Kept together because the line is written and read here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

NODES = ("prepare", "flaky", "approve", "work", "finish")
LEDGER_NODES = ("prepare", "flaky", "work", "finish")
COMPLETED = LEDGER_NODES
"""A finished run's `checkpoint.completed`: the executed nodes (an answered human node is
recorded as its output, not as a completed node)."""

# `$RUNFLEET_WORKSPACE` is `<data>/work/<run_id>/<lease token>`: the line names the run and the
# execution without any help from the workflow's vars.
_LINE = (
    'W="$RUNFLEET_WORKSPACE"; echo "$(date +%s.%N) $(basename "$(dirname "$W")") {node}'
    ' $(basename "$W")" >> {target}'
)
WORKFLOW = f"""\
# The soak's workflow: every tool node appends one line per execution to a ledger.
name: soak
entry: prepare
vars:
  ledger:
    type: string
  done:
    type: string
  work_s:
    type: number
    default: 1
nodes:
  prepare:
    kind: tool
    # The run's attachment must be readable here, wherever a kill moved the run (SPEC §13.11).
    run: {
    json.dumps(
        "test -s {{ attachments.seed.path }} && "
        + _LINE.format(node="prepare", target="{{ vars.ledger }}")
    )
}
  flaky:
    kind: tool
    retry:
      max: 0
    run: {
    json.dumps(
        'if [ ! -f "$RUNFLEET_SCRATCH_DIR/flaky.marker" ]; then'
        ' touch "$RUNFLEET_SCRATCH_DIR/flaky.marker"; exit 75; fi; '
        + _LINE.format(node="flaky", target="{{ vars.ledger }}")
    )
}
  approve:
    kind: human
    questions:
      - name: approved
        type: bool
  work:
    kind: tool
    timeout: 120s
    run: {
    json.dumps(_LINE.format(node="work", target="{{ vars.ledger }}") + "; sleep {{ vars.work_s }}")
}
  finish:
    kind: tool
    run: {
    json.dumps(
        _LINE.format(node="finish", target="{{ vars.ledger }}")
        + "; "
        + _LINE.format(node="finish", target="{{ vars.done }}")
    )
}
edges:
  - from: prepare
    to: flaky
  - from: flaky
    to: approve
  - from: approve
    to: work
    when: answers.approved
  - from: work
    to: finish
"""


def _ledger(path: Path) -> dict[str, list[tuple[float, str, str]]]:
    """run id -> [(time, node, execution token)] in file order."""
    out: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out[parts[1]].append((float(parts[0]), parts[2], parts[3]))
    return out
