"""`engine.references`: the node names a workflow's expressions and templates read outputs of,
from their syntax trees (what `runfleet validate` warns about when no node has the name)."""

from __future__ import annotations

from engine.loader import load_workflow
from engine.references import output_references, references

SOURCE = """\
name: refs
entry: fetch
nodes:
  fetch:
    kind: tool
    run: "echo outputs.not_a_reference; echo {{ outputs.fetcher }} {{ outputs['other'] }}"
  score:
    kind: compute
    set:
      total: "outputs.fetch + outputs['scorer'] if 'maybe' in outputs else 0"
  ask:
    kind: human
    message: "Saw {{ outputs.score.total }} {{ outputs.get('maybe', '') }}"
    questions: [{name: ok, type: bool}]
  call:
    kind: call
    function: "pkg.mod:fn"
    inputs: {a: {b: ["{{ outputs.deep }}"]}, c: 3, d: "{{ outputs.top }}"}
  stop:
    kind: fail
    code: STOPPED
    message: "{{ outputs.gone }}"
edges:
  - {from: fetch, to: score, when: "outputs.fetchh != ''"}
  - {from: score, to: ask}
  - {from: ask, to: call}
  - {from: call, to: stop}
"""


def test_every_outputs_name_is_found_where_it_is_and_nothing_else() -> None:
    workflow = load_workflow(SOURCE, "refs.yaml").workflow

    found = sorted(set(output_references(workflow)))

    assert found == sorted(
        {
            ("edges[0].when", "fetchh"),
            ("node 'fetch'", "fetcher"),
            ("node 'fetch'", "other"),
            ("node 'score'", "fetch"),
            ("node 'score'", "scorer"),
            ("the message of node 'ask'", "score"),
            ("node 'call'", "top"),  # a nested value is passed as written, never rendered
            ("the message of node 'stop'", "gone"),
        }
    )


def test_vars_named_are_found_as_outputs_are() -> None:
    source = """\
name: v
entry: a
vars:
  who: {type: string, default: Ada}
nodes:
  a: {kind: tool, run: "echo {{ vars.who }} {{ vars['whom'] }}"}
  b: {kind: compute, set: {x: "vars.count + 1"}}
edges:
  - {from: a, to: b, when: "vars.flag"}
"""
    workflow = load_workflow(source, "v.yaml").workflow

    assert sorted(set(references(workflow, "vars"))) == [
        ("edges[0].when", "flag"),
        ("node 'a'", "who"),
        ("node 'a'", "whom"),
        ("node 'b'", "count"),
    ]
