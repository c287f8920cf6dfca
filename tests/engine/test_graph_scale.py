"""Big graphs (a scale drill): walking a workflow is linear in its edges. A rewind of a
1 500-node chain took 3 minutes (one walk per node after it, each scanning every edge) and froze
the API serving it; `validate` of a 1 000-node chain was `internal` (a recursive cycle search);
a 5 000-node workflow without aliases was told its "aliases expand". Each test below would run
for hours, or fail, on the code before (the suite's timeout is 120 s)."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from engine.errors import WorkflowInvalid
from engine.loader import MAX_VALUES, load_workflow
from engine.rewind import dropped_by_rewind, reachable
from engine.workflow import Workflow
from runner.cli.main import cli

CHAIN = 3_000


def chain(n: int, *, back: bool = False) -> str:
    nodes = "".join(f"  n{i}:\n    kind: compute\n    set:\n      x: '1'\n" for i in range(n))
    edges = "".join(f"  - from: n{i}\n    to: n{i + 1}\n" for i in range(n - 1))
    if back:
        edges += f"  - from: n{n - 1}\n    to: n0\n    loop: {{name: again, max: 3}}\n"
    return f"name: c\nentry: n0\nnodes:\n{nodes}edges:\n{edges}"


def naive_dropped(workflow: Workflow, node: str) -> set[str]:
    """The rule as first written: `node` and what follows it that cannot lead back to it."""
    return {node} | {n for n in reachable(workflow, node) if node not in reachable(workflow, n)}


@pytest.mark.parametrize("seed", range(20))
def test_rewind_drops_what_the_rule_says_on_random_graphs(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    nodes = "".join(f"  n{i}:\n    kind: compute\n    set:\n      x: '1'\n" for i in range(n))
    pairs = {(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 2 * n))}
    edges = "".join(
        f"  - from: n{a}\n    to: n{b}\n    loop: {{name: l{a}x{b}, max: 2}}\n" for a, b in pairs
    )
    workflow = load_workflow(f"name: r\nentry: n0\nnodes:\n{nodes}edges:\n{edges}", "r.yaml")
    for node in workflow.workflow.nodes:
        assert dropped_by_rewind(workflow.workflow, node) == naive_dropped(workflow.workflow, node)


def test_rewind_of_a_long_chain_drops_every_node_after_its_target() -> None:
    workflow = load_workflow(chain(CHAIN), "c.yaml").workflow
    assert dropped_by_rewind(workflow, "n0") == {f"n{i}" for i in range(CHAIN)}
    looped = load_workflow(chain(CHAIN, back=True), "c.yaml").workflow
    assert dropped_by_rewind(looped, "n10") == {"n10"}  # everything after leads back to it


def test_validate_takes_a_chain_of_thousands_of_nodes(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "chain.yaml"  # type: ignore[operator]
    path.write_text(chain(CHAIN, back=True))
    result = CliRunner().invoke(cli, ["validate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert '"valid": true' in result.output


def test_a_workflow_too_large_without_aliases_is_told_so_not_blamed_on_aliases() -> None:
    n = MAX_VALUES // 8
    with pytest.raises(WorkflowInvalid) as caught:
        load_workflow(chain(n), "big.yaml")
    message = caught.value.problems[0].message
    assert "too large" in message and "aliases" not in message
