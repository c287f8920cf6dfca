"""A server that cannot listen where it was told is a usage error (SPEC §10: exit 2 naming the
flag as typed, the value and why), never `error [internal]`: `runfleet console --port` on a port
in use, `--host` on an address this machine cannot bind, and `runfleet up --api-port` on a port
in use — which `up` refuses before it starts anything, so there is no fleet to stop.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import RUNFLEET, fleet_env, processes_of, run_to_exit


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


def test_console_says_on_stderr_when_its_token_file_no_longer_reads_or_tenants_share_a_host(
    tmp_path: Path,
) -> None:
    """A token file edited into something that does not read keeps the tokens read before, and
    the docs promise the server's log says why; that log line went to no handler (a security
    walkthrough). `runfleet console` writes its log to stderr."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tok default operate\ntheirs bravo read\n")
    env = {**fleet_env(tmp_path / "data"), "RUNFLEET_API_TOKENS": str(tokens)}
    proc = subprocess.Popen(
        [str(RUNFLEET), "console", "--port", "0"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        url, before = "", []
        while not url:
            line = proc.stderr.readline()
            assert line, "the console exited before it said where it listens"
            before.append(line)
            if line.startswith("runfleet API on "):
                url = line.split(" on ", 1)[1].strip()
        # Two tenants on the `local` sandbox: said at start (the boundary is not the sandbox's).
        assert any("2 tenants (bravo, default)" in x and "kubernetes" in x for x in before)
        tokens.write_text("tok default operate\nother default admin\n")  # role misspelt
        request = urllib.request.Request(
            f"{url}/api/v1/runs", headers={"Authorization": "Bearer tok"}
        )
        for _ in range(50):  # the server looks at the file at most once a second
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200  # the tokens read before stay
            if not select.select([proc.stderr], [], [], 0.1)[0]:
                continue
            said = proc.stderr.readline()
            if "RUNFLEET_API_TOKENS" in said:
                break
        else:
            raise AssertionError("the console never said the token file does not read")
        assert "ERROR" in said and "the tokens read before stay" in said and "line 2" in said
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)  # and closes its stderr
