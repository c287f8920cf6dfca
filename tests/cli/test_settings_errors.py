"""Bad settings and flag values are usage errors in the user's names (SPEC §10 v2.2, §12).

Every field of every settings model is fed a value it must refuse; the error names the variable
as the user types it (`RUNFLEET_LEASE_TTL`), the value and the accepted form, and the CLI prints
it with exit code 2 — never a validation library's dump or a web link. Relation checks name
every variable they relate. A read-only command does not read the settings it does not use.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from engine.config import EngineSettings
from publisher.config import WireSettings
from runner.cli.errors import EXIT_USAGE, exit_code_for, fail
from runner.config import RunnerSettings
from store.settings import RunfleetSettings, SettingsInvalid, env_name
from store.sizes import parse_size

ROOT = Path(__file__).resolve().parents[2]
RUNFLEET = Path(sys.executable).parent / "runfleet"
PACKAGES = ("store", "engine", "publisher", "runner")


def settings_models() -> list[type[BaseSettings]]:
    """Every settings model of the product packages (imported here, so none is missed)."""
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    found: list[type[BaseSettings]] = []
    todo: list[type[BaseSettings]] = [BaseSettings]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] in PACKAGES and cls is not RunfleetSettings:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


MODELS = settings_models()
FIELDS = [(model, field) for model in MODELS for field in model.model_fields]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for key in [k for k in os.environ if k.startswith("RUNFLEET_")]:
        monkeypatch.delenv(key)
    yield monkeypatch


def candidates(tmp_path: Path) -> list[str]:
    """Values that some field must refuse: not a number, negative, a unit that is none, a name
    with a space, empty, a missing file, a file where a directory belongs."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return ["abc", "-3", "12 parsecs", "not valid!", "", "/nonexistent/x", str(a_file)]


def test_every_settings_model_reads_through_the_one_mapping() -> None:
    assert {m.__name__ for m in MODELS} >= {
        "EngineSettings",
        "RunnerSettings",
        "StoreSettings",
        "WireSettings",
    }
    for model in MODELS:
        assert issubclass(model, RunfleetSettings), f"{model.__name__} skips the mapping"


@pytest.mark.parametrize(("model", "field"), FIELDS, ids=[f"{m.__name__}.{f}" for m, f in FIELDS])
def test_a_bad_setting_is_a_usage_error_naming_the_variable_and_the_value(
    model: type[BaseSettings],
    field: str,
    clean_env: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = env_name(field)
    refused: list[tuple[str, SettingsInvalid]] = []
    for value in candidates(tmp_path):
        clean_env.setenv(name, value)
        try:
            model()
        except SettingsInvalid as exc:
            refused.append((value, exc))
    assert refused, f"{name} accepts every value tried: give the field a form it checks"
    for value, exc in refused:
        assert exc.names == (name,), exc.message
        assert f"{name}={value!r}" in exc.message
        assert "expected " in exc.message
        assert exc.remedy is not None and name in exc.remedy
        assert exit_code_for(exc) == EXIT_USAGE
    value, exc = refused[0]
    with pytest.raises(SystemExit) as exited:
        fail(exc, as_json=False)
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error [settings_invalid]: {name}={value!r}")
    assert "remedy: " in err
    for dump in ("validation error", "pydantic", "http", "input_value", field + "\n"):
        assert dump not in err


RELATIONS = [
    (WireSettings, {"RUNFLEET_ACK_WAIT": "5s"}, ("ACK_WAIT", "LEASE_TTL", "LEASE_SKEW"), "32s"),
    (EngineSettings, {"RUNFLEET_LEASE_INTERVAL": "20s"}, ("LEASE_INTERVAL", "LEASE_TTL"), "10s"),
    (
        EngineSettings,
        {"RUNFLEET_LEASE_LOSS_MARGIN": "15s"},
        ("LEASE_LOSS_MARGIN", "LEASE_TTL", "LEASE_INTERVAL"),
        "10s",
    ),
    (
        EngineSettings,
        {"RUNFLEET_SCRATCH_BANK_BUDGET": "6m"},
        ("SCRATCH_BANK_BUDGET", "TEARDOWN_BUDGET"),
        "5m",
    ),
    (
        WireSettings,
        {"RUNFLEET_PUBLISH_RETRY_BUDGET": "1m"},
        ("PUBLISH_RETRY_BUDGET", "SWEEPER_GRACE"),
        "1m",
    ),
    (
        WireSettings,
        {"RUNFLEET_DUPLICATE_WINDOW": "90s"},
        ("DUPLICATE_WINDOW", "SWEEPER_GRACE", "SWEEPER_INTERVAL"),
        "90s",
    ),
    (
        RunnerSettings,
        {"RUNFLEET_TRANSIENT_DELAY": "20m"},
        ("TRANSIENT_DELAY", "TRANSIENT_DELAY_CAP"),
        "10m",
    ),
]

POSITIVE = [
    (EngineSettings, "LEASE_TTL"),
    (EngineSettings, "LEASE_INTERVAL"),
    (EngineSettings, "LEASE_LOSS_MARGIN"),
    (EngineSettings, "NODE_CANCEL_BUDGET"),
    (EngineSettings, "TEARDOWN_BUDGET"),
    (EngineSettings, "SCRATCH_BANK_BUDGET"),
    (EngineSettings, "POST_ENGINE_BUDGET"),
    (WireSettings, "LEASE_TTL"),
    (WireSettings, "ACK_WAIT"),
    (WireSettings, "DUPLICATE_WINDOW"),
    (WireSettings, "PUBLISH_TIMEOUT"),
    (WireSettings, "PUBLISH_RETRY_BUDGET"),
    (WireSettings, "SWEEPER_GRACE"),
    (WireSettings, "SWEEPER_INTERVAL"),
    (RunnerSettings, "TRANSIENT_DELAY"),
    (RunnerSettings, "TRANSIENT_DELAY_CAP"),
    (RunnerSettings, "FETCH_TIMEOUT"),
    (RunnerSettings, "LAGGING_DELAY"),
    (RunnerSettings, "UNSUPPORTED_SCHEMA_DELAY"),
    (RunnerSettings, "DRAIN_NAK_DELAY"),
    (RunnerSettings, "HEALTHY_WITHIN"),
]
"""A lease, an interval, a delay or a budget of 0 was taken and did harm without a word (a
clocks review): a TTL of 0 parked every run, a transient delay of 0 became a plain nak that
spent a run's deliveries in milliseconds, a loss margin of 0 was replaced by TTL/6."""


@pytest.mark.parametrize(
    ("model", "name"), POSITIVE, ids=[f"{m.__name__}-{n}" for m, n in POSITIVE]
)
def test_a_lease_interval_delay_or_budget_of_zero_is_refused_naming_its_variable(
    model: type[BaseSettings], name: str, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv(f"RUNFLEET_{name}", "0s")
    with pytest.raises(SettingsInvalid) as caught:
        model()
    assert caught.value.names == (f"RUNFLEET_{name}",)
    assert f"RUNFLEET_{name}='0s' is not accepted: expected a positive duration" in (
        caught.value.message
    )


@pytest.mark.parametrize(("model", "env", "names", "hint"), RELATIONS)
def test_a_broken_relation_between_settings_names_every_variable_it_relates(
    model: type[BaseSettings],
    env: dict[str, str],
    names: tuple[str, ...],
    hint: str,
    clean_env: pytest.MonkeyPatch,
) -> None:
    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(SettingsInvalid) as caught:
        model()
    exc = caught.value
    assert exc.names == tuple(f"RUNFLEET_{n}" for n in names)
    for key, value in env.items():
        assert f"{key}={value}" in exc.message  # the value as typed
    assert exc.remedy is not None and f"RUNFLEET_{names[0]}" in exc.remedy
    assert hint in exc.remedy or hint in exc.message
    assert exit_code_for(exc) == EXIT_USAGE


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 * 1024**2),
        ("1GB", 10**9),
        ("1gb", 10**9),
        ("512 KiB", 512 * 1024),
        ("1048576", 1048576),
        ("1.5GiB", int(1.5 * 1024**3)),
    ],
)
def test_sizes_accept_units_as_durations_do(
    text: str, size: int, clean_env: pytest.MonkeyPatch
) -> None:
    assert parse_size(text) == size
    clean_env.setenv("RUNFLEET_SCRATCH_CAP", text)
    assert EngineSettings().scratch_cap == size


# -- through the real `runfleet` ---------------------------------------------------------------


def runfleet(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    clean["RUNFLEET_DATA"] = str(tmp_path / "data")
    clean["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing there: never a real fleet
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "env", "name"),
    [
        (("run", "examples/hello.yaml"), {"RUNFLEET_LEASE_TTL": "abc"}, "RUNFLEET_LEASE_TTL"),
        (("dlq", "replay", "1"), {"RUNFLEET_ACK_WAIT": "5s"}, "RUNFLEET_ACK_WAIT"),
        (("dlq", "list"), {"RUNFLEET_NATS_URL": "localhost:4222"}, "RUNFLEET_NATS_URL"),
        (("runner",), {"RUNFLEET_SLOTS": "-3"}, "RUNFLEET_SLOTS"),
        (("run", "examples/hello.yaml"), {"RUNFLEET_SCRATCH_CAP": "lots"}, "RUNFLEET_SCRATCH_CAP"),
        (("runs",), {"RUNFLEET_STORE_URL": "postgres://x"}, "RUNFLEET_STORE_URL"),
    ],
)
def test_runfleet_exits_2_naming_the_setting_as_typed(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], name: str
) -> None:
    result = runfleet(tmp_path, *args, **env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    value = env[name]
    assert f"{name}={value!r}" in result.stderr or f"{name}={value}" in result.stderr
    assert "remedy:" in result.stderr
    assert "pydantic" not in result.stderr and "http" not in result.stderr
    if args[0] == "runner":  # a process, not a command with a document to print
        return
    as_json = runfleet(tmp_path, *args, "--json", **env)
    assert as_json.returncode == 2
    error = json.loads(as_json.stdout)["error"]
    assert error["code"] == "settings_invalid" and name in error["message"] and error["remedy"]


def test_a_read_only_command_does_not_trip_on_settings_it_does_not_read(tmp_path: Path) -> None:
    """`runs` reads the store settings only, `dlq list` those and where NATS is: a bad lease,
    ack-wait or sandbox setting is not their concern (the commands that execute, rewind,
    publish or run the fleet refuse it)."""
    result = runfleet(
        tmp_path, "runs", RUNFLEET_LEASE_TTL="abc", RUNFLEET_ACK_WAIT="5s", RUNFLEET_SANDBOX="x"
    )
    assert result.returncode == 0, result.stderr
    # `dlq list` reads where NATS is, not the lease or the consumer's ack wait: it gets as far
    # as the (absent) server.
    listed = runfleet(tmp_path, "dlq", "list", RUNFLEET_LEASE_TTL="abc", RUNFLEET_ACK_WAIT="5s")
    assert listed.returncode == 4, listed.stderr
    assert listed.stderr.startswith("error [nats_unavailable]")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("runs", "--since", "abc"), "--since"),
        (("dlq", "list", "--older-than", "abc"), "--older-than"),
        (("dlq", "purge", "--all", "--older-than", "abc"), "--older-than"),
        (("gc", "--older-than", "abc"), "--older-than"),
        (("resume", "0123456789", "--max-duration", "abc"), "--max-duration"),
    ],
)
def test_a_bad_duration_flag_is_a_usage_error_naming_the_flag(
    tmp_path: Path, args: tuple[str, ...], flag: str
) -> None:
    result = runfleet(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"'{flag}'" in result.stderr and "'abc'" in result.stderr
    assert "duration such as 30s" in result.stderr
    assert "Traceback" not in result.stderr and "internal" not in result.stderr


def test_flag_durations_reach_the_operations_parsed() -> None:
    from runner.cli.options import DURATION

    assert DURATION.convert("90s", None, None) == timedelta(seconds=90)


def test_a_store_url_no_backend_can_open_is_a_usage_error_naming_the_variable(
    tmp_path: Path,
) -> None:
    for env in (
        {"RUNFLEET_BLOB_URL": "s3://Bad_Bucket!"},
        {"RUNFLEET_BLOB_URL": "s3://bucket/p", "RUNFLEET_S3_ENDPOINT": "ftp://x"},
    ):
        result = runfleet(tmp_path, "runs", **env)
        assert result.returncode == 2, (env, result.stderr)
        assert result.stderr.startswith("error [settings_invalid]: RUNFLEET_BLOB_URL")
        assert all(value in result.stderr for value in env.values())
