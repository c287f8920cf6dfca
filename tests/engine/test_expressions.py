"""Safe expressions (SPEC §6.1, ADR-0005): attribute access over data, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import ExpressionError
from engine.expressions import compile_check, evaluate, evaluate_condition


@pytest.fixture
def ctx() -> dict[str, Any]:
    return {
        "vars": {"n": 2, "name": "Ada"},
        "outputs": {"build": {"ok": True, "items": [1, 2, 3], "keys": "k"}},
        "answers": {"approved": False},
        "loop": {"steps": 1},
        "budget": {"max_iterations": None},
    }


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("vars.n + 1", 3),
        ("outputs.build.ok and vars.n > 1", True),
        ("len(outputs.build.items)", 3),
        ("outputs.build.keys", "k"),  # a field named like a dict method reads the data
        ("outputs['build']['ok']", True),
        ("not answers.approved", True),
        ("loop.steps < 3", True),
        ("max(vars.n, budget.max_iterations or 0)", 2),
        ("[x * 2 for x in outputs.build.items if x > 1]", [4, 6]),
        ("'build' in outputs", True),
        ("vars.name.lower()", "ada"),
        ("round(vars.n / 3, 2)", 0.67),
        ("str(vars.n) + '!'", "2!"),
        ("'yes' if vars.n == 2 else 'no'", "yes"),
    ],
)
def test_expressions_read_the_context(ctx: dict[str, Any], expr: str, expected: Any) -> None:
    compile_check(expr)
    assert evaluate(expr, ctx) == expected


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "vars.__class__",
        "().__class__.__bases__[0].__subclasses__()",
        "outputs.build.__dict__",
        "eval('1')",
        "open('/etc/passwd')",
        "vars.name.format(vars)",
        "lambda: 1",
        "getattr(vars, 'n')",
    ],
)
def test_no_eval_and_no_dunder_access(ctx: dict[str, Any], expr: str) -> None:
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert info.value.expression == expr
    assert info.value.code == "expression_failed"
    with pytest.raises(ExpressionError):
        compile_check(expr)


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("vars.missing", "vars has no field 'missing'"),
        ("outputs.nope.ok", "outputs has no field 'nope'"),
        ("vars.n.real", "not a mapping"),
        ("1 / 0", "ZeroDivisionError"),
        ("vars.n +", "syntax error"),
        ("x = 1", "syntax error"),
    ],
)
def test_runtime_failures_are_expression_errors_naming_the_expression(
    ctx: dict[str, Any], expr: str, fragment: str
) -> None:
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert fragment in str(info.value)
    assert repr(expr) in str(info.value)


@pytest.mark.parametrize(
    "expr", ["foo + 1", "var.n", "vars.n +", "", "a @ b", "(x := 1)", "vars.n.__add__(1)"]
)
def test_compile_check_refuses_at_load(expr: str) -> None:
    with pytest.raises(ExpressionError):
        compile_check(expr)


def test_comprehension_variables_are_known_names() -> None:
    compile_check("[item for item in outputs.build.items]")


def test_condition_is_truthiness(ctx: dict[str, Any]) -> None:
    assert evaluate_condition("outputs.build.items", ctx) is True
    assert evaluate_condition("answers.approved", ctx) is False


@pytest.mark.parametrize(
    "expr",
    [
        "4000000**4000000 > 1",  # operands within simpleeval's MAX_POWER, the result is not
        '[4000000**4000000 for x in "a"*9999]',
        "2**4097",
        "(-3)**100000",
    ],
)
def test_a_power_whose_result_is_too_large_is_refused_typed(ctx: dict[str, Any], expr: str) -> None:
    compile_check(expr)  # nothing static is wrong with it
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert "over 4096 bits" in info.value.detail
    assert info.value.expression == expr


def test_powers_within_the_bound_still_compute(ctx: dict[str, Any]) -> None:
    assert evaluate("2**10", ctx) == 1024
    assert evaluate("(-3)**3", ctx) == -27
    assert evaluate("2**-1", ctx) == 0.5
    assert evaluate("2**4096", ctx) == 1 << 4096
    assert evaluate("1**4000000", ctx) == 1


def test_repetition_past_the_sequence_bound_is_refused_typed(ctx: dict[str, Any]) -> None:
    for expr in ['"a" * 100001', "[1] * 100001", "(1,) * 100001"]:
        with pytest.raises(ExpressionError):
            evaluate(expr, ctx)
    assert len(evaluate('"a" * 100000', ctx)) == 100000


def test_an_expression_that_builds_too_much_in_all_is_refused_typed(
    ctx: dict[str, Any],
) -> None:
    # Each string and the comprehension's length pass simpleeval's own per-operation bounds;
    # together they would be ~900 MB.
    expr = 'len(["a"*99999 for x in "a"*9000])'
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert "builds over" in info.value.detail
    assert evaluate('len(["a"*999 for x in "a"*9000])', ctx) == 9000


@pytest.mark.parametrize("expr", ["1" + "+1" * 100_000, "-" * 100_000 + "1"])
def test_an_expression_too_deeply_nested_to_parse_is_refused_typed(
    ctx: dict[str, Any], expr: str
) -> None:
    with pytest.raises(ExpressionError) as info:
        compile_check(expr)
    assert "too deeply nested" in info.value.detail
    with pytest.raises(ExpressionError):
        evaluate(expr, ctx)


@pytest.mark.parametrize(
    ("expr", "refusal"),
    [
        ("'%1000000000s' % 'x'", "formatted string would be over"),
        ("'%*s' % (10**9, 'x')", "formatted string would be over"),
        ("'%.1000000000f' % 1.5", "formatted string would be over"),
        ("f'{1:>1000000000}'", "f-string would be over"),
        ("f'{1:>{10**9}}'", "f-string would be over"),
    ],
)
def test_formatting_with_a_huge_width_is_refused_before_it_allocates(
    ctx: dict[str, Any], expr: str, refusal: str
) -> None:
    # simpleeval measured the string only once made (a gigabyte for these).
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert refusal in info.value.detail


@pytest.mark.parametrize(
    "expr",
    [
        "str(['x' * 100000] * 100000)",
        "f'{[\"x\" * 100000] * 100000}'",
        "'%s' % [['x' * 100000] * 100000]",
        "['x' * 100000] * 100000",  # the value itself: stored as JSON, 10**10 characters
    ],
)
def test_a_value_whose_text_repeats_a_shared_item_is_refused_before_it_is_made_text(
    ctx: dict[str, Any], expr: str
) -> None:
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, ctx)
    assert "over" in info.value.detail


def test_ordinary_formatting_and_str_still_compute(ctx: dict[str, Any]) -> None:
    assert evaluate("'%05.1f|%s|%%' % (3.14159, vars.name)", ctx) == "003.1|Ada|%"
    assert evaluate("'%(a)s-%(a)s' % {'a': vars.n}", ctx) == "2-2"
    assert evaluate("7 % 3", ctx) == 1
    assert evaluate("f'{vars.n:>3}|{vars.name}|{outputs.build.items}'", ctx) == "  2|Ada|[1, 2, 3]"
    assert evaluate("str(outputs.build.items)", ctx) == "[1, 2, 3]"
    assert len(evaluate("['x' * 1000] * 1000", ctx)) == 1000
