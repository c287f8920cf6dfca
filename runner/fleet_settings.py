"""The settings a `runfleet up` fleet runs with, shared with every command that finds it through
`RUNFLEET_DATA` (ADR-0019).

`up` is configured by the `RUNFLEET_*` variables of the shell it starts in, and its runners
inherit them; a command in another shell found the fleet through `$DATA/nats.url` and read
everything else from *its own* environment. With a `RUNFLEET_MAX_DELIVER=3` fleet, a plain
`runfleet sweep` there was `consumer_mismatch`, and the `runfleet streams ensure` its remedy
named rewrote the live consumer to the default 10 — after which every runner `up` restarted
refused to start (found by an operator walkthrough). A `RUNFLEET_STORE_URL` given to `up` was
likewise missed, so the other shell read another store.

So `up` writes what it runs with to `$DATA/fleet-settings.json` (beside `nats.url`, replaced
whole), and a command that finds the fleet there takes each value its own environment does not
set. Where the data lives (`DATA_LOCATION`: the store, the blob store and its S3 endpoint) is
a property of the data dir, not of a running fleet: when `up` stops it cuts the file down to
those, and a command run while no fleet runs (`runs`, `status`, `gc`, `upload`) still reads the
same store and blobs (ADR-0019 amendment 1: a `gc` cron job on a stopped S3 fleet deleted the
runs and left their S3 objects, read through the filesystem default). A variable set in the
command's shell still wins: that is how an operator changes a fleet on purpose
(`RUNFLEET_MAX_DELIVER=5 runfleet streams ensure`, then the runners restarted with it).

Not shared: `RUNFLEET_DATA` and `RUNFLEET_NATS_URL` (how the fleet is found), a runner's own
`RUNFLEET_HTTP_PORT`, and secrets (`*_TOKEN`, `*_PASSWORD`, `*_SECRET`): the console and the
API read those from their own shell. A relative SQLite URL is written as the absolute path `up`
opened, since the other shell may stand in another directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from publisher.config import NATS_URL_FILE
from store.url import SQLITE_PREFIX

FLEET_SETTINGS_FILE = "fleet-settings.json"
PREFIX = "RUNFLEET_"
NOT_SHARED = frozenset({"RUNFLEET_DATA", "RUNFLEET_NATS_URL", "RUNFLEET_HTTP_PORT"})
DATA_LOCATION = frozenset(
    {"RUNFLEET_STORE_URL", "RUNFLEET_BLOB_URL", "RUNFLEET_S3_ENDPOINT", "RUNFLEET_S3_REGION"}
)
"""Kept in the file after `up` stops, and taken while no fleet runs: where the runs are."""
SECRET = re.compile(r"(TOKEN|PASSWORD|SECRET)$")


def shared_settings(environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The `RUNFLEET_*` values of `environ` another command needs to act on this fleet."""
    out: dict[str, str] = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(PREFIX) or name in NOT_SHARED or SECRET.search(name):
            continue
        if name == "RUNFLEET_STORE_URL" and value.startswith(SQLITE_PREFIX):
            path = Path(value[len(SQLITE_PREFIX) :])
            value = f"{SQLITE_PREFIX}{cwd / path}" if not path.is_absolute() else value
        out[name] = value
    return out


def write(data: Path, settings: Mapping[str, str]) -> str:
    """Replace the file whole (a reader never sees half of it); private to the user, as the
    store it sits beside. Returns what was written, the only content `remove` may delete."""
    text = json.dumps({"settings": dict(settings)}, indent=2, sort_keys=True) + "\n"
    staged = data / f"{FLEET_SETTINGS_FILE}.{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    staged.replace(data / FLEET_SETTINGS_FILE)
    return text


def keep_location(data: Path, written: str) -> None:
    """At `up`'s stop: cut the file down to where the data lives (`DATA_LOCATION`), or remove
    it when the fleet ran on the defaults. Only what this fleet wrote: anything else belongs to
    another `up`."""
    path = data / FLEET_SETTINGS_FILE
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() != written:
            return
        settings = json.loads(written)["settings"]
        kept = {k: v for k, v in settings.items() if k in DATA_LOCATION}
        if kept:
            write(data, kept)
        else:
            path.unlink()


def adopt(
    environ: MutableMapping[str, str], warn: Callable[[str], None] | None = None
) -> list[str]:
    """Fill the variables `environ` does not set from the fleet found through `RUNFLEET_DATA`
    (all of them while its `nats.url` says it runs, only `DATA_LOCATION` otherwise); returns
    the names taken. Nothing when `RUNFLEET_NATS_URL` names a NATS of its own (that command is
    not talking to an `up` fleet), or when the file cannot be read — the command then runs on
    its own settings, as before, and `warn` is told (found by an operator walkthrough: a
    truncated file was ignored without a word, and `streams ensure` from that shell undid the
    fleet's consumer settings)."""
    if environ.get("RUNFLEET_NATS_URL"):
        return []
    path = settings_path(environ)
    running = (path.parent / NATS_URL_FILE).is_file()
    try:
        loaded = json.loads(path.read_text())
        settings = loaded["settings"]
        if not isinstance(settings, dict):
            raise TypeError("its `settings` is not an object")
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if warn is not None:
            warn(
                f"{path.resolve()} cannot be read ({type(exc).__name__}: {exc}); this command"
                " runs on its own RUNFLEET_* settings, which may not be the fleet's (`runfleet"
                " up` writes the file again when it starts)"
            )
        return []
    taken: list[str] = []
    for name, value in settings.items():
        if (
            isinstance(name, str)
            and isinstance(value, str)
            and name.startswith(PREFIX)
            and name not in NOT_SHARED
            and name not in environ
            and (running or name in DATA_LOCATION)
        ):
            environ[name] = value
            taken.append(name)
    return taken


def settings_path(environ: Mapping[str, str]) -> Path:
    """The file `adopt` reads for this environment."""
    return Path(environ.get("RUNFLEET_DATA") or ".runfleet") / FLEET_SETTINGS_FILE
