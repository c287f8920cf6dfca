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


def _refused_for_too_much_work(text: str, ctx: dict[str, Any]) -> TemplateError:
    """`text` loads (nothing is folded or built while compiling) and its render is refused
    with the typed template error, for too much work."""
    compile_check(text)
    with pytest.raises(TemplateError) as info:
        render(text, ctx, shell=False)
    assert info.value.code == "template_failed"
    assert info.value.failure_code.name == "EXPRESSION_FAILED"
    assert info.value.detail.startswith("too much work"), info.value.detail
    return info.value


DOUBLING = (
    "{% set s = namespace(v=START) %}{% for i in range(60) %}{% set s.v = GROW %}{% endfor %}"
    "{{ s.v|length }}"
)


@pytest.mark.parametrize(
    ("start", "grow"),
    [
        ("'x'", "s.v ~ s.v"),  # `~` compiles to a plain join no sandbox hook used to see
        ("'x'", "s.v + s.v"),
        ("'x'", "'%s%s' % (s.v, s.v)"),
        ("'x'", "'{}{}'.format(s.v, s.v)"),
        ("'x'", "[s.v, s.v]|join"),
        ("'x'", "s.v.join(['', '', ''])"),
        ("[1]", "s.v + s.v"),
    ],
)
def test_a_template_that_doubles_a_string_in_a_loop_is_refused_before_it_exhausts_memory(
    ctx: dict[str, Any], start: str, grow: str
) -> None:
    text = DOUBLING.replace("START", start).replace("GROW", grow)
    _refused_for_too_much_work(text, ctx)


def test_a_value_whose_text_repeats_a_shared_item_is_refused_before_it_is_made_text(
    ctx: dict[str, Any],
) -> None:
    # `[v, v]` doubled 60 times is 60 small lists whose JSON is 2**60 items long.
    nested = "{% set s = namespace(v=[1]) %}{% for i in range(60) %}{% set s.v = [s.v, s.v] %}"
    for shown in ["{{ s.v }}", "{{ s }}", "{{ s.v|tojson }}", "{{ s.v|string }}", "{{ s.v ~ '' }}"]:
        _refused_for_too_much_work(nested + "{% endfor %}" + shown, ctx)
    for shown in ["{{ big }}", "{{ big|join }}", "{{ ','.join(big) }}", "{{ '%s' % big }}"]:
        _refused_for_too_much_work("{% set big = ['x' * 100000] * 100000 %}" + shown, ctx)


@pytest.mark.parametrize(
    "text",
    [
        "{{ 'x'|center(1000000000) }}",  # a constant width: Jinja used to run it while compiling
        "{{ 'x'|center(10**9) }}",
        "{{ 'x'|indent(10**9, true) }}",
        "{{ ('\n' * 100000)|indent('y' * 1000, blank=true) }}",
        "{{ ('x' * 100000)|wordwrap(1, wrapstring='y' * 100000) }}",
        "{{ '%*s'|format(10**9, 'x') }}",
        "{{ '%1000000000s'|format('x') }}",
        "{{ '%1000000000s' % 'x' }}",
        "{{ '%.1000000000f' % 1.5 }}",
        "{{ ('x' * 100000)|replace('x', 'x' * 100000) }}",
        "{{ [1]|batch(10**9, 0)|list|length }}",
        "{{ [1]|slice(10**9)|list|length }}",
        "{{ ([[1]] * 100000)|sum(start=[])|length }}",
    ],
)
def test_a_filter_asked_for_a_huge_width_or_count_is_refused_before_it_allocates(
    ctx: dict[str, Any], text: str
) -> None:
    _refused_for_too_much_work(text, ctx)


@pytest.mark.parametrize(
    "text",
    [
        "{{ 'x'.center(10**9) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 'x'.zfill(10**9) }}",
        "{{ ('\t' * 100000).expandtabs(100000) }}",
        "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
        "{{ ('x' * 1000).translate({120: 'y' * 100000}) }}",
        "{{ '{:>1000000000}'.format(1) }}",
        "{{ '{:>{w}}'.format(1, w=10**9) }}",
        "{{ '{a:>1000000000}'.format_map({'a': 1}) }}",
    ],
)
def test_a_string_method_asked_for_a_huge_result_is_refused_before_it_allocates(
    ctx: dict[str, Any], text: str
) -> None:
    _refused_for_too_much_work(text, ctx)


def test_many_medium_concatenations_are_bounded_per_render(ctx: dict[str, Any]) -> None:
    # Each `~` makes 200 000 characters, well within one string's bound; a thousand of them are
    # more than one render may build.
    text = "{% set x = 'x' * 100000 %}{% for i in range(1000) %}{% set y = x ~ x %}{% endfor %}"
    error = _refused_for_too_much_work(text, ctx)
    assert "one render builds over" in error.detail
    # the budget is per render
    ok = "{% set x = 'x' * 100000 %}{% for i in range(100) %}{% set y = x ~ x %}{% endfor %}ok"
    assert render(ok, ctx, shell=False) == "ok"
    assert render(ok, ctx, shell=False) == "ok"


def test_nested_loops_over_lists_are_bounded_in_iterations(ctx: dict[str, Any]) -> None:
    text = "{% set a = [0] * 100000 %}{% for i in a %}{% for j in a %}{% endfor %}{% endfor %}"
    error = _refused_for_too_much_work(text, ctx)
    assert "loop iterations" in error.detail
    # a recursive loop's inner levels count as well
    ctx["vars"]["tree"] = [{"c": [{"c": [0] * 100000}] * 20}]
    deep = (
        "{% for x in vars.tree recursive %}{% if x is mapping %}{{ loop(x.c) }}{% endif %}"
        "{% endfor %}"
    )
    assert "loop iterations" in _refused_for_too_much_work(deep, ctx).detail


def test_a_macro_that_calls_itself_twice_is_bounded_in_calls(ctx: dict[str, Any]) -> None:
    text = (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    )
    assert "calls" in _refused_for_too_much_work(text, ctx).detail


def test_lipsum_which_makes_text_of_any_size_is_not_a_template_name() -> None:
    with pytest.raises(TemplateError, match="unknown name 'lipsum'"):
        compile_check("{{ lipsum(10**6) }}")


def test_ordinary_text_building_renders_as_before(ctx: dict[str, Any]) -> None:
    text = (
        "{{ '{a}-{0:>4}'.format(7, a='x') }} {{ '{a}'.format_map({'a': 1}) }}"
        " {{ '%s=%d'|format('n', 3) }} {{ 'a-b'|replace('-', '+') }} {{ ['a', 'b']|join(',') }}"
        " {{ [1, 2]|sum }} {{ [[1], [2]]|sum(start=[]) }} [{{ 'ab'|center(6) }}]"
        " {{ 'x' ~ 1 ~ [2] }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 7 % 3 }} {{ '%05.1f' % 3.14159 }}"
        " {{ 'a\nb'|indent(2, true) }} {{ 'a b c'|wordwrap(3) }}"
        " {{ 'abcdef'|truncate(5, leeway=0) }}"
        " {{ ','.join(['p', 'q']) }} {{ 'ab'.rjust(4, '.') }} {{ [1, 2, 3]|batch(2, 0)|list }}"
    )
    assert render(text, ctx, shell=False) == (
        "x-   7 1 n=3 a+b a,b 3 [1, 2] [  ab  ] x1[2] ab [1, 2] 1 003.1   a\n  b a b\nc ab..."
        " p,q ..ab [[1, 2], [3, 0]]"
    )
    loop = (
        "{% set ns = namespace(s='') %}{% for i in range(3) %}{% set ns.s = ns.s ~ i ~ ',' %}"
        "{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %}{% endfor %}"
        "{% for x in [] %}{% else %}empty{% endfor %} {{ ns.s }}"
    )
    assert render(loop, ctx, shell=False) == "1/32/33/3!empty 0,1,2,"
    # within the bounds, a long string can still be built and rendered
    assert len(render("{{ 'x' * 100000 ~ 'y' * 100000 }}", ctx, shell=False)) == 200_000


def test_an_int_squared_in_a_loop_is_refused_before_it_outgrows_the_power_bound() -> None:
    """`*` on ints grows as `**` does when it is repeated: bounded alike (4096 bits)."""
    squaring = (
        "{% set n = namespace(x=3) %}{% for i in range(40) %}{% set n.x = n.x * n.x %}"
        "{% endfor %}{{ n.x }}"
    )
    with pytest.raises(TemplateError, match="too much work: the product would be over 4096 bits"):
        render(squaring, {}, shell=False)
    assert render("{{ (2 ** 2000) * (2 ** 2000) > 0 }}", {}, shell=False) == "true"
