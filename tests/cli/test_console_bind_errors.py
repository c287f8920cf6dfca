"""A server that cannot listen where it was told is a usage error (SPEC §10: exit 2 naming the
flag as typed, the value and why), never `error [internal]`: `runfleet console --port` on a port
in use, `--host` on an address this machine cannot bind, and `runfleet up --api-port` on a port
in use — which `up` refuses before it starts anything, so there is no fleet to stop.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import fleet_env, processes_of, run_to_exit


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something already listens on (127.0.0.1)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def runfleet(data: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_to_exit(data, args, {**fleet_env(data), **env})


def assert_usage_error(result: subprocess.CompletedProcess[str], *, flag: str, value: str) -> str:
    err = result.stderr
    assert result.returncode == 2, err
    assert f"Invalid value for '{flag}': {value}" in err, err
    assert "internal" not in err and "Traceback" not in err, err
    return err


def test_console_on_a_port_in_use_is_a_usage_error_naming_port(
    tmp_path: Path, busy_port: int
) -> None:
    result = runfleet(tmp_path / "data", "console", "--port", str(busy_port))
    err = assert_usage_error(result, flag="--port", value=str(busy_port))
    assert "address already in use" in err


@pytest.mark.parametrize("host", ["999.1.1.1", "192.0.2.1"])
def test_console_on_an_address_it_cannot_bind_is_a_usage_error_naming_host(
    tmp_path: Path, host: str
) -> None:
    """`999.1.1.1` is no address at all; 192.0.2.1 (TEST-NET-1) is one no interface has."""
    result = runfleet(tmp_path / "data", "console", "--host", host, "--port", "0")
    err = assert_usage_error(result, flag="--host", value=repr(host))
    assert "cannot bind that address" in err


def test_up_on_an_api_port_in_use_is_a_usage_error_before_the_fleet_starts(
    tmp_path: Path, busy_port: int
) -> None:
    data = tmp_path / "data"
    result = runfleet(
        data, "up", "--runners", "1", "--no-view", "--data", str(data), "--api-port", str(busy_port)
    )
    err = assert_usage_error(result, flag="--api-port", value=str(busy_port))
    assert "address already in use" in err
    # Refused before anything started: no nats-server, no runner, no URL for the CLI to find.
    assert "runfleet up:" not in err
    assert not (data / "nats.url").exists()
    assert not (data / "logs").exists()
    assert not processes_of(data)


def test_up_with_a_tokens_file_it_cannot_use_is_a_usage_error_before_the_fleet_starts(
    tmp_path: Path,
) -> None:
    """As `runfleet console` does: a fleet that ran on without the API it was asked to serve
    would only say so in a line scrolled away."""
    tokens = tmp_path / "tokens"
    tokens.write_text("only-a-token\n")
    data = tmp_path / "data"
    result = runfleet(
        data, "up", "--runners", "1", "--no-view", "--data", str(data),
        RUNFLEET_API_TOKENS=str(tokens),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "RUNFLEET_API_TOKENS" in result.stderr and "line 1" in result.stderr
    assert "runfleet up:" not in result.stderr
    assert not (data / "nats.url").exists()
    assert not processes_of(data)
