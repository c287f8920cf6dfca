"""A command that finds no fleet says so (found by an operator walkthrough): with neither
`RUNFLEET_NATS_URL` nor a `nats.url` under `RUNFLEET_DATA`, the default address is tried, and
"cannot reach NATS at nats://127.0.0.1:4222" sent a person looking for a server they never
started. The fallback address is replaced by a port where nothing listens, so no NATS this
machine happens to run on 4222 can answer."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

from publisher.config import NATS_URL_FILE, UP_LOCK_FILE, NatsSettings
from publisher.connection import connect
from publisher.errors import NatsUnavailable

NOTHING_THERE = "nats://127.0.0.1:1"


def resolved(path: Path) -> Path:
    return path.resolve()


async def test_no_fleet_in_the_data_dir_is_said_with_how_to_start_or_find_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(NatsSettings, "nats_servers", lambda self: [NOTHING_THERE])

    with pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=None))

    assert caught.value.message.startswith(
        f"no `runfleet up` fleet is running on {resolved(tmp_path)} (no nats.url there)"
    )
    assert "runfleet up" in (caught.value.remedy or "")
    assert "RUNFLEET_DATA" in (caught.value.remedy or "")


async def test_a_fleets_address_that_does_not_answer_is_named_with_retry_then_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runfleet up` would be refused while the fleet's processes hold its lock: the remedy
    says retry (a dead nats-server is restarted by `up`), then what to stop."""
    (tmp_path / NATS_URL_FILE).write_text(NOTHING_THERE + "\n")  # a fleet that was killed
    # ... whose runners still hold its lock
    with held_lock(tmp_path / UP_LOCK_FILE), pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=None))
    assert caught.value.message.startswith(
        f"the `runfleet up` fleet on {resolved(tmp_path)} does not answer at {NOTHING_THERE}"
    )
    remedy = caught.value.remedy or ""
    assert "retry in a few seconds" in remedy and str(resolved(tmp_path) / "up.lock") in remedy


async def test_a_url_file_left_by_a_fleet_that_is_gone_says_to_start_one(
    tmp_path: Path,
) -> None:
    """Found by a walkthrough: with the killed `up` and everything it started gone, the
    remedy still said "retry in a few seconds". No one holds the lock: no fleet runs."""
    (tmp_path / NATS_URL_FILE).write_text(NOTHING_THERE + "\n")
    (tmp_path / UP_LOCK_FILE).write_text("12345\n")  # left, held by no one
    with pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=None))
    assert caught.value.message.startswith(
        f"no `runfleet up` fleet is running on {resolved(tmp_path)}: its {NATS_URL_FILE}"
    )
    assert "is left from one that is gone" in caught.value.message
    assert "start the fleet again" in (caught.value.remedy or "")


async def test_a_fleet_that_has_not_written_its_url_yet_is_said_to_be_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` writes `nats.url` only once its streams take messages (a cluster elects for
    seconds first): a command meanwhile finds the lock held and no URL. "No fleet is running"
    would be wrong; it is told to wait for `up`."""
    monkeypatch.setattr(NatsSettings, "nats_servers", lambda self: [NOTHING_THERE])
    with held_lock(tmp_path / UP_LOCK_FILE), pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=None))
    assert caught.value.message.startswith(
        f"the `runfleet up` fleet on {resolved(tmp_path)} is starting or stopping"
    )
    assert "wait until `runfleet up` prints that it runs" in (caught.value.remedy or "")


@contextlib.contextmanager
def held_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


async def test_an_explicit_nats_url_that_does_not_answer_is_named_as_before(
    tmp_path: Path,
) -> None:
    with pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=NOTHING_THERE))
    assert caught.value.message.startswith(f"cannot reach NATS at {NOTHING_THERE}")


@pytest.mark.parametrize("content", ["", "\n", "garbage%%\n", "nats://ok:1, not-a-url\n"])
async def test_a_fleets_url_file_that_holds_no_url_is_named_as_the_file(
    tmp_path: Path, content: str
) -> None:
    """An operator walkthrough: an emptied `nats.url` was `error [internal]: ValueError('no
    server in RUNFLEET_NATS_URL None')`, exit 1, blaming a variable nobody had set."""
    (tmp_path / NATS_URL_FILE).write_text(content)
    with pytest.raises(NatsUnavailable) as caught:
        await connect(NatsSettings(data=tmp_path, nats_url=None))
    path = resolved(tmp_path) / NATS_URL_FILE
    assert caught.value.message.startswith(f"{path} holds no NATS URL")
    assert "runfleet up" in (caught.value.remedy or "") and str(path) in (caught.value.remedy or "")
