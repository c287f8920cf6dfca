"""The fleet's Prometheus alert rules (`deploy/base/runner/prometheusrule.yaml`), offline.

- The object: the `cloudcoil` PrometheusRule model generated from the Prometheus Operator 0.80
  CRD schema; it must round-trip unchanged (an unknown or misspelled field fails), as the
  PodMonitor does in test_render_and_schemas.py.
- Every series an `expr` selects is one the runner's registry exposes (runner/metrics.py, as
  prometheus-client writes it: `_total`, `_bucket`/`_sum`/`_count`, `_info`), or `up`, which
  Prometheus writes per target; every label matched is one that series carries (or a target
  label the PodMonitor adds); every label value matched is one the code writes; `job` is the
  PodMonitor's; the consumer gauges are never summed; every range is at least two scrapes.
- Every alert has a `for:`, a `severity` of `page` or `ticket`, a summary, a description and a
  `runbook` naming a heading of docs/operations.md (GitHub's anchors).
- The rule file is part of every build `kubectl kustomize` renders, in namespace `runfleet`.

No Prometheus here: the PromQL is read by a small tokenizer (its own test below), neither
evaluated nor parsed by Prometheus's parser; `promtool check rules` on the rule groups does
that where promtool is installed.
"""

from __future__ import annotations

import re
from collections import Counter as Tally
from functools import cache
from typing import Any

import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule
from prometheus_client.metrics import MetricWrapperBase

from runner.metrics import RunnerMetrics
from store import RunStatus
from tests.deploy.manifests import BUILDS, DEPLOY, ROOT, kubectl_binary, kustomize_build

RULES_NAME = "prometheusrule.yaml"
RUNNER_PART = DEPLOY / "base" / "runner"
RULES = RUNNER_PART / RULES_NAME
OPERATIONS = ROOT / "docs" / "operations.md"
SEVERITIES = {"page", "ticket"}
# Series Prometheus writes itself for every target, with the target's labels.
SCRAPE_SERIES = {"up"}
# Labels the Prometheus Operator puts on every series of a PodMonitor's targets.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}
# Where the code that writes the runner's label values lives.
SOURCES = ("runner", "engine")
PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan",
}  # fmt: skip
CONSUMER_GAUGES = ("runfleet_num_pending", "runfleet_num_ack_pending")

Manifest = dict[str, Any]


# -- helpers ------------------------------------------------------------------------------------


def load_rule() -> Manifest:
    docs = [d for d in yaml.safe_load_all(RULES.read_text()) if d]
    assert len(docs) == 1, f"{RULES} must hold exactly one object"
    rule: Manifest = docs[0]
    return rule


def alerts(rule: Manifest) -> list[Manifest]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


@cache
def exposed_series() -> dict[str, set[str]]:
    """Every sample name the runner's `/metrics` can write, with the labels each carries: a
    child is made for every labelled metric first (a labelled counter writes no sample before
    its first event)."""
    metrics = RunnerMetrics()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and value._labelnames:
            value.labels(*("x" for _ in value._labelnames))
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (github-slugger): the heading's text,
    lower-cased, without punctuation but `-` and `_`, spaces as `-`; a repeat gets `-1`, `-2`."""
    anchors: set[str] = set()
    seen: Tally[str] = Tally()
    fence: str | None = None
    for line in markdown.splitlines():
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if opening:
            mark = opening.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
            elif mark.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text
        text = text.replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


STRING = r'"(?:[^"\\]|\\.)*"'
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(rf"([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*({STRING})")


def selectors(expr: str) -> list[tuple[str | None, list[tuple[str, str, str]]]]:
    """Each `name{matchers}` of an expression: its name (None for a bare `{…}`) and its
    matchers as (label, operator, value)."""
    found = []
    for match in SELECTOR.finditer(expr):
        matchers = [(lbl, op, yaml.safe_load(val)) for lbl, op, val in MATCHER.findall(match[2])]
        found.append((match[1], matchers))
    return found


def metric_names(expr: str) -> set[str]:
    """The series names an expression reads: every identifier left once strings, matchers, grouping
    label lists, ranges, offsets and numbers are taken out, that is not a function call or a
    PromQL keyword."""
    rest = re.sub(STRING, " ", expr)
    rest = re.sub(r"\{[^}]*\}", " ", rest)
    rest = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)
    rest = re.sub(r"\boffset\s+\w+", " ", rest)
    names = set()
    for match in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", rest):
        if match[1].lower() not in PROMQL_WORDS:
            names.add(match[1])
    return names


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    return sum(int(n) * units[u] for n, u in parts)


@cache
def written_values() -> str:
    """The project code that writes label values, as one text to look string literals up in."""
    return "\n".join(
        path.read_text() for part in SOURCES for path in sorted((ROOT / part).rglob("*.py"))
    )


def podmonitor() -> tuple[str, Manifest]:
    """The runner's PodMonitor and the namespace its kustomization puts it in."""
    kustomization = yaml.safe_load((RUNNER_PART / "kustomization.yaml").read_text())
    monitor = yaml.safe_load((RUNNER_PART / "podmonitor.yaml").read_text())
    return kustomization["namespace"], monitor


# -- the object ---------------------------------------------------------------------------------


def test_the_rule_object_round_trips_through_the_prometheus_operator_model() -> None:
    rule = load_rule()
    parsed = PrometheusRule.model_validate(rule)
    again = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert again == rule, "the PrometheusRule has fields its CRD schema does not know"
    assert rule["metadata"]["name"] == "runfleet"
    assert rule["metadata"]["namespace"] == "runfleet"


def test_the_rule_carries_the_labels_the_podmonitor_carries() -> None:
    """One selector label set for the fleet's monitoring objects: a Prometheus whose
    ruleSelector picks the rule by the labels it picks the PodMonitor by finds both."""
    _, monitor = podmonitor()
    assert load_rule()["metadata"]["labels"] == monitor["metadata"]["labels"]


def test_every_alert_has_a_for_a_severity_and_its_annotations() -> None:
    rule = load_rule()
    names = [a["alert"] for a in alerts(rule)]
    assert len(names) == len(set(names)), "two alerts share a name"
    assert 6 <= len(names) <= 12, f"{len(names)} alerts: keep the set small enough to act on"
    for alert in alerts(rule):
        name = alert["alert"]
        assert re.fullmatch(r"Runfleet[A-Z]\w+", name), name
        seconds(alert["for"])  # a duration Prometheus reads
        assert alert["labels"]["severity"] in SEVERITIES, name
        for key in ("summary", "description", "runbook"):
            assert alert["annotations"].get(key, "").strip(), f"{name}: no {key}"
    assert {a["labels"]["severity"] for a in alerts(rule)} == SEVERITIES


def test_every_runbook_names_a_heading_of_the_operations_doc() -> None:
    anchors = github_anchors(OPERATIONS.read_text())
    for alert in alerts(load_rule()):
        runbook = alert["annotations"]["runbook"]
        doc, _, anchor = runbook.partition("#")
        assert doc == "docs/operations.md", f"{alert['alert']}: {runbook}"
        assert anchor in anchors, f"{alert['alert']}: no heading of {doc} has #{anchor}"


def test_the_anchor_reader_gives_githubs_anchors() -> None:
    """Checked against the links docs/operations.md already makes to its own headings."""
    text = OPERATIONS.read_text()
    anchors = github_anchors(text)
    assert "2-watch-it" in anchors and "change-a-setting-on-purpose" in anchors
    assert "3-the-dlq" in anchors and "the-first-week-upkeep" in anchors
    assert "dev-a-single-server" not in github_anchors("```sh\n# dev: a single server\n```\n")
    assert github_anchors("## A\n## A\n") == {"a", "a-1"}


# -- the expressions ----------------------------------------------------------------------------


@pytest.mark.parametrize("alert", alerts(load_rule()), ids=lambda a: str(a["alert"]))
def test_every_series_and_label_an_expression_reads_is_exposed(alert: Manifest) -> None:
    expr = str(alert["expr"])
    series = exposed_series()
    names = metric_names(expr)
    assert names, f"no series read in {expr!r}"
    for name in names:
        assert name in series or name in SCRAPE_SERIES, (
            f"{alert['alert']}: {name} is not exposed by the runner's registry"
        )
    for selected, matchers in selectors(expr):
        assert selected is not None, f"{alert['alert']}: a selector without a series name"
        carried = series.get(selected, set()) | TARGET_LABELS
        for label, _, _ in matchers:
            assert label in carried, f"{alert['alert']}: {selected} has no label {label!r}"


@pytest.mark.parametrize("alert", alerts(load_rule()), ids=lambda a: str(a["alert"]))
def test_every_label_value_matched_is_one_the_fleet_writes(alert: Manifest) -> None:
    code = written_values()
    statuses = {str(s) for s in RunStatus}
    namespace, monitor = podmonitor()
    for name, matchers in selectors(str(alert["expr"])):
        for label, op, value in matchers:
            if label == "job":
                assert (op, value) == ("=", f"{namespace}/{monitor['metadata']['name']}"), (
                    f"{alert['alert']}: the PodMonitor's targets have job "
                    f"{namespace}/{monitor['metadata']['name']}"
                )
                continue
            if label in TARGET_LABELS:
                continue
            assert op in ("=", "=~"), f"{alert['alert']}: only = and =~ are checked"
            values = value.split("|") if op == "=~" else [value]
            for one in values:
                assert re.fullmatch(r"\w+", one), f"{alert['alert']}: {one!r} is not a plain value"
                known = one in statuses if label == "status" else f'"{one}"' in code
                assert known, f"{alert['alert']}: nothing writes {name}{{{label}={one!r}}}"


@pytest.mark.parametrize("alert", alerts(load_rule()), ids=lambda a: str(a["alert"]))
def test_every_range_spans_two_scrapes(alert: Manifest) -> None:
    _, monitor = podmonitor()
    interval = max(seconds(e["interval"]) for e in monitor["spec"]["podMetricsEndpoints"])
    expr = str(alert["expr"])
    for window in re.findall(r"\[([^\]:]+)(?::[^\]]*)?\]", expr):
        assert seconds(window) >= 2 * interval, f"{alert['alert']}: [{window}] < 2 scrapes"
    for window in re.findall(r"\boffset\s+(\w+)", expr):
        assert seconds(window) >= 2 * interval, f"{alert['alert']}: offset {window}"


@pytest.mark.parametrize("alert", alerts(load_rule()), ids=lambda a: str(a["alert"]))
def test_the_consumer_gauges_are_never_summed_over_runners(alert: Manifest) -> None:
    """Every runner reports the same consumer's numbers: `sum()` multiplies them by the
    number of runners (docs/operations.md: graph `max()`)."""
    expr = str(alert["expr"])
    for gauge in CONSUMER_GAUGES:
        summed = rf"\b(sum|avg|count)\s*(\b(by|without)\s*\([^)]*\))?\s*\(\s*{gauge}\b"
        assert not re.search(summed, expr), f"{alert['alert']}: {gauge} summed"


def test_the_tokenizer_reads_what_the_rules_are_made_of() -> None:
    expr = (
        'sum by (reason) (increase(runfleet_dlq_records_total{reason=~"a|b"}[30m])) > 0\n'
        "or count by (reason) (runfleet_dlq_records_total unless "
        "runfleet_dlq_records_total offset 30m)\n"
        "and on() histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m]))) > 1e3"
    )
    assert metric_names(expr) == {"runfleet_dlq_records_total", "x_bucket"}
    assert selectors(expr) == [("runfleet_dlq_records_total", [("reason", "=~", "a|b")])]
    assert seconds("1h30m") == 5400


# -- the kustomize builds -----------------------------------------------------------------------


def test_the_rule_file_is_listed_in_the_runner_parts_kustomization() -> None:
    listed = yaml.safe_load((RUNNER_PART / "kustomization.yaml").read_text())["resources"]
    assert RULES_NAME in listed, f"{RULES} is not listed in its kustomization.yaml"


def test_every_build_renders_the_rule_unchanged_in_the_runners_namespace() -> None:
    kubectl = kubectl_binary()
    source = load_rule()
    for build, path in BUILDS.items():
        rendered = [m for m in kustomize_build(kubectl, path) if m["kind"] == "PrometheusRule"]
        assert len(rendered) == 1, f"{build}: {len(rendered)} PrometheusRules rendered"
        rule = rendered[0]
        assert rule["metadata"]["name"] == "runfleet", build
        assert rule["metadata"]["namespace"] == "runfleet", build
        assert rule["spec"] == source["spec"], f"{build}: the rendered rules differ from the file"
        labels = rule["metadata"]["labels"]
        assert source["metadata"]["labels"].items() <= labels.items(), build
        again = PrometheusRule.model_validate(rule).model_dump(
            mode="json", by_alias=True, exclude_unset=True
        )
        assert again == rule, f"{build}: the rendered PrometheusRule does not round-trip"
