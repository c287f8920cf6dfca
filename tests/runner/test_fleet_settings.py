"""`runner.fleet_settings` (ADR-0019): what a `runfleet up` shares with the commands that find it
through `RUNFLEET_DATA`, and how they take it. End to end with a real fleet:
`tests/cli/test_fleet_settings_shared.py`."""

from __future__ import annotations

import json
from pathlib import Path

from publisher.config import NATS_URL_FILE
from runner import fleet_settings
from runner.fleet_settings import FLEET_SETTINGS_FILE


def test_shared_settings_leave_out_how_the_fleet_is_found_a_runners_port_and_secrets() -> None:
    environ = {
        "RUNFLEET_MAX_DELIVER": "3",
        "RUNFLEET_DATA": "/d",
        "RUNFLEET_NATS_URL": "nats://x:1",
        "RUNFLEET_HTTP_PORT": "0",
        "RUNFLEET_CONSOLE_TOKEN": "s3cret",
        "RUNFLEET_API_TOKENS": "/etc/tokens",
        "HOME": "/root",
    }
    shared = fleet_settings.shared_settings(environ, Path("/work"))
    assert shared == {"RUNFLEET_MAX_DELIVER": "3", "RUNFLEET_API_TOKENS": "/etc/tokens"}


def test_a_relative_sqlite_url_is_shared_as_the_absolute_path_the_fleet_opened() -> None:
    shared = fleet_settings.shared_settings(
        {"RUNFLEET_STORE_URL": "sqlite:///db/runs.db"}, Path("/srv/fleet")
    )
    assert shared == {"RUNFLEET_STORE_URL": "sqlite:////srv/fleet/db/runs.db"}
    absolute = {"RUNFLEET_STORE_URL": "sqlite:////abs/runs.db"}
    assert fleet_settings.shared_settings(absolute, Path("/x")) == absolute


def _running_fleet(data: Path, settings: dict[str, str]) -> str:
    data.mkdir(parents=True, exist_ok=True)
    (data / NATS_URL_FILE).write_text("nats://127.0.0.1:4999\n")
    return fleet_settings.write(data, settings)


def test_a_command_takes_what_its_own_shell_does_not_set_and_its_own_values_win(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    _running_fleet(data, {"RUNFLEET_MAX_DELIVER": "3", "RUNFLEET_LEASE_TTL": "9s"})
    environ = {"RUNFLEET_DATA": str(data), "RUNFLEET_LEASE_TTL": "12s"}

    taken = fleet_settings.adopt(environ)

    assert taken == ["RUNFLEET_MAX_DELIVER"]
    assert environ["RUNFLEET_MAX_DELIVER"] == "3"
    assert environ["RUNFLEET_LEASE_TTL"] == "12s"  # an operator changing the fleet on purpose
    assert (data / FLEET_SETTINGS_FILE).stat().st_mode & 0o077 == 0  # the user's only


def test_nothing_is_taken_without_a_running_fleet_or_with_a_nats_of_ones_own(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    _running_fleet(data, {"RUNFLEET_MAX_DELIVER": "3"})
    own_nats = {"RUNFLEET_DATA": str(data), "RUNFLEET_NATS_URL": "nats://elsewhere:4222"}
    assert fleet_settings.adopt(own_nats) == []

    (data / NATS_URL_FILE).unlink()  # the fleet stopped (or crashed and is gone)
    assert fleet_settings.adopt({"RUNFLEET_DATA": str(data)}) == []


def test_where_the_data_lives_is_kept_after_the_fleet_stops_and_taken_without_it(
    tmp_path: Path,
) -> None:
    """A `gc` cron job on a stopped S3 fleet read the filesystem default: it deleted the runs
    and left their S3 objects (ADR-0019 amendment 1)."""
    data = tmp_path / "data"
    location = {
        "RUNFLEET_BLOB_URL": "s3://bucket/fleet",
        "RUNFLEET_S3_ENDPOINT": "http://127.0.0.1:9000",
        "RUNFLEET_STORE_URL": "sqlite:////srv/runs.db",
    }
    written = _running_fleet(data, {**location, "RUNFLEET_MAX_DELIVER": "3"})

    fleet_settings.keep_location(data, written)  # `up` stops
    (data / NATS_URL_FILE).unlink()

    environ = {"RUNFLEET_DATA": str(data)}
    assert sorted(fleet_settings.adopt(environ)) == sorted(location)
    assert "RUNFLEET_MAX_DELIVER" not in environ  # a fleet's behaviour, not where its data is
    assert (data / FLEET_SETTINGS_FILE).stat().st_mode & 0o077 == 0


def test_a_fleet_on_the_default_locations_leaves_no_file_behind(tmp_path: Path) -> None:
    data = tmp_path / "data"
    written = _running_fleet(data, {"RUNFLEET_MAX_DELIVER": "3"})
    fleet_settings.keep_location(data, written)
    assert not (data / FLEET_SETTINGS_FILE).exists()


def test_a_file_that_does_not_parse_is_ignored_and_never_sets_what_is_not_shared(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    _running_fleet(data, {})
    (data / FLEET_SETTINGS_FILE).write_text('{"settings": {"RUNFLEET_MAX_DELIVER": "3",')
    said: list[str] = []
    assert fleet_settings.adopt({"RUNFLEET_DATA": str(data)}, warn=said.append) == []
    # said, naming the file (an operator walkthrough: it was ignored without a word)
    assert len(said) == 1 and str((data / FLEET_SETTINGS_FILE).resolve()) in said[0]
    assert "its own RUNFLEET_* settings" in said[0]

    forged = {"RUNFLEET_DATA": "/elsewhere", "RUNFLEET_SLOTS": 4, "PATH": "/evil"}
    (data / FLEET_SETTINGS_FILE).write_text(json.dumps({"settings": forged}))
    environ = {"RUNFLEET_DATA": str(data)}
    assert fleet_settings.adopt(environ) == []
    assert environ == {"RUNFLEET_DATA": str(data)}


def test_the_fleet_cuts_down_only_the_file_it_wrote(tmp_path: Path) -> None:
    data = tmp_path / "data"
    written = _running_fleet(data, {"RUNFLEET_MAX_DELIVER": "3"})
    other = fleet_settings.write(data, {"RUNFLEET_MAX_DELIVER": "4"})  # another `up` since

    fleet_settings.keep_location(data, written)
    assert (data / FLEET_SETTINGS_FILE).read_text() == other
    fleet_settings.keep_location(data, other)
    assert not (data / FLEET_SETTINGS_FILE).exists()
