"""Templates (SPEC §6.1, §8): shell-quoted unless `| raw`; strict, except for attachments."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from engine.errors import TemplateError
from engine.templates import compile_check, render

HOSTILE = "a b; touch pwned"


@pytest.fixture
def ctx() -> dict[str, Any]:
    return {
        "vars": {"name": HOSTILE, "n": 3, "flag": True, "opts": {"k": [1, 2]}},
        "outputs": {"build": {"items": "data"}},
        "attachments": {"doc": {"path": "/run/runfleet/attachments/doc.pdf"}},
    }


def test_shell_values_are_quoted(ctx: dict[str, Any]) -> None:
    command = render("echo hello {{ vars.name }}", ctx, shell=True)
    assert command == "echo hello 'a b; touch pwned'"
    # the shell sees one argument, and runs no second command
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    assert out.stdout == f"hello {HOSTILE}\n"


def test_raw_opts_out_of_quoting(ctx: dict[str, Any]) -> None:
    assert render("echo {{ vars.name | raw }}", ctx, shell=True) == f"echo {HOSTILE}"


def test_plain_rendering_does_not_quote(ctx: dict[str, Any]) -> None:
    assert render("hi {{ vars.name }}", ctx, shell=False) == f"hi {HOSTILE}"


def test_values_render_as_text_and_json(ctx: dict[str, Any]) -> None:
    text = "{{ vars.n }} {{ vars.flag }} {{ vars.opts }} {{ outputs.build.items }}"
    assert render(text, ctx, shell=False) == '3 true {"k": [1, 2]} data'
    assert render("{{ vars.opts }}", ctx, shell=True) == "'{\"k\": [1, 2]}'"


def test_missing_attachment_renders_empty(ctx: dict[str, Any]) -> None:
    text = "cat {{ attachments.doc.path }} {{ attachments.missing.path }}{{ attachments.doc.url }}"
    assert render(text, ctx, shell=False) == "cat /run/runfleet/attachments/doc.pdf "
    # with shell quoting an absent value is an empty word, keeping argument positions
    assert render("cat {{ attachments.missing.path }}", ctx, shell=True) == "cat ''"
    assert render("{{ attachments.x.path }}", {"vars": {}}, shell=False) == ""


@pytest.mark.parametrize("text", ["{{ vars.nope }}", "{{ nope }}", "{{ outputs.x.y }}"])
def test_undefined_var_is_an_error(ctx: dict[str, Any], text: str) -> None:
    with pytest.raises(TemplateError) as info:
        render(text, ctx, shell=True)
    assert info.value.template == text
    assert text in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "{{ vars.name.__class__ }}",
        "{{ vars.opts.update({}) }}",
        "{{ '{0.__class__}'.format(vars) }}",
    ],
)
def test_the_sandbox_refuses_python_internals(ctx: dict[str, Any], text: str) -> None:
    with pytest.raises(TemplateError):
        render(text, ctx, shell=False)


def test_syntax_errors_carry_the_template_line() -> None:
    with pytest.raises(TemplateError) as info:
        compile_check("echo one\necho {{ vars.x", shell=True)
    assert info.value.lineno == 2


def test_compile_check_refuses_unknown_roots_and_filters() -> None:
    compile_check("{{ vars.x }} {{ attachments.a.path }} {{ outputs.n.f | raw }}", shell=True)
    with pytest.raises(TemplateError, match="unknown name 'var'"):
        compile_check("{{ var.x }}")
    with pytest.raises(TemplateError):
        compile_check("{{ vars.x | nosuchfilter }}")


def test_a_huge_power_is_not_folded_at_load_and_is_refused_typed_at_render(
    ctx: dict[str, Any],
) -> None:
    text = "{{ 3999999 ** 3999999 }}"
    compile_check(text, shell=True)  # Jinja used to constant-fold it here, and hang
    with pytest.raises(TemplateError) as info:
        render(text, ctx, shell=True)
    assert "over 4096 bits" in info.value.detail
    assert render("{{ 2 ** 10 }} {{ 2 ** -1 }}", ctx, shell=False) == "1024 0.5"


def test_repetition_past_the_sequence_bound_is_refused_typed(ctx: dict[str, Any]) -> None:
    ctx["vars"]["big"] = 200_001
    with pytest.raises(TemplateError) as info:
        render('{{ "a" * vars.big }}', ctx, shell=False)
    assert "too much work" in info.value.detail
    with pytest.raises(TemplateError):
        render("{{ vars.big * [1] }}", ctx, shell=False)
    assert (
        render('{{ "ab" * 3 }} {{ 3 * 4 }} {{ [1] * 2 }}', ctx, shell=False) == "ababab 12 [1, 1]"
    )


def test_range_is_bounded_per_call_and_per_render_typed(ctx: dict[str, Any]) -> None:
    with pytest.raises(TemplateError) as info:
        render("{% for i in range(10001) %}{% endfor %}", ctx, shell=False)
    assert "range of 10001 items" in info.value.detail
    nested = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError) as info:
        render(nested, ctx, shell=False)
    assert "ranges of one render" in info.value.detail
    # the budget is per render: a fresh render may use it all again
    assert render("{% for i in range(10000) %}{% endfor %}ok", ctx, shell=False) == "ok"
    assert render("{% for i in range(10000) %}{% endfor %}ok", ctx, shell=False) == "ok"


def test_what_one_render_builds_and_outputs_is_bounded_typed(ctx: dict[str, Any]) -> None:
    with pytest.raises(TemplateError) as info:
        render('{% for i in range(200) %}{% set s = "a" * 99999 %}{% endfor %}', ctx, shell=False)
    assert "`*`s make over" in info.value.detail
    ctx["vars"]["chunk"] = "a" * 10_000
    with pytest.raises(TemplateError) as info:
        render("{% for i in range(2000) %}{{ vars.chunk }}{% endfor %}", ctx, shell=False)
    assert "output is over" in info.value.detail


def test_a_template_too_deeply_nested_to_compile_is_refused_typed() -> None:
    with pytest.raises(TemplateError) as info:
        compile_check("{{ " + "1+" * 100_000 + "1 }}")
    assert "too deeply nested" in info.value.detail
