"""Budgets (SPEC §6.4): caps come from the launch and persisted overrides; accounting
(`Checkpoint.usage`) never resets or decreases (SPEC §13.7)."""

from __future__ import annotations

from store import Budget, BudgetUsage


def merge_overrides(budget: Budget, overrides: Budget | None) -> Budget:
    """Per-field merge: an override replaces that cap only; unset fields keep the launch cap."""
    if overrides is None:
        return budget
    fields = overrides.model_dump(exclude_none=True)
    return budget.model_copy(update=fields)


def exceeded(budget: Budget, usage: BudgetUsage) -> str | None:
    """Which cap the accounting has reached, or None. Checked before each node and by the
    post-claim preflight, so an exhausted run re-parks before any sandbox starts."""
    if budget.max_iterations is not None and usage.iterations >= budget.max_iterations:
        return f"max_iterations {budget.max_iterations} reached ({usage.iterations} used)"
    if budget.max_duration is not None and usage.elapsed >= budget.max_duration:
        return f"max_duration {budget.max_duration:g}s reached ({usage.elapsed:.1f}s used)"
    if budget.max_cost_usd is not None and usage.cost_usd >= budget.max_cost_usd:
        return f"max_cost_usd {budget.max_cost_usd:g} reached ({usage.cost_usd:g} used)"
    return None


def below_consumed(budget: Budget, usage: BudgetUsage) -> list[str]:
    """Override fields that would set a cap below what is already consumed (a refusal)."""
    out = []
    if budget.max_iterations is not None and budget.max_iterations < usage.iterations:
        out.append("max_iterations")
    if budget.max_duration is not None and budget.max_duration < usage.elapsed:
        out.append("max_duration")
    if budget.max_cost_usd is not None and budget.max_cost_usd < usage.cost_usd:
        out.append("max_cost_usd")
    return out
