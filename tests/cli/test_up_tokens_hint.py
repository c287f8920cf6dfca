"""What `runfleet up` says of its API and console follows the tokens it has (SPEC v2.2 §10b,
§10c). Found by a new-user walkthrough: with an `operate` token in `RUNFLEET_API_TOKENS` and no
`RUNFLEET_CONSOLE_TOKEN`, it said "(set RUNFLEET_CONSOLE_TOKEN)" and a read-only console, yet
that token wrote through the API and logs in to the console."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli.conftest import Up, eventually, stop_cleanly

CONSOLE = re.compile(r"^  console on http://\S+/ui/(.*)$", re.MULTILINE)
API = re.compile(r"^  HTTP API on http://\S+/api/v1(.*)$", re.MULTILINE)


def said(up: Up) -> tuple[str, str] | None:
    out = up.output()
    console, api = CONSOLE.search(out), API.search(out)
    return (api.group(1), console.group(1)) if console and api else None


def test_without_a_token_up_says_the_api_refuses_and_the_console_is_read_only(fleet: Up) -> None:
    api, console = eventually(lambda: said(fleet), within=30, what="up's API and console lines")
    assert api == " (no token: set RUNFLEET_CONSOLE_TOKEN or RUNFLEET_API_TOKENS)"
    assert console == " (read-only: no operate token)"


def test_an_operate_token_from_the_tokens_file_is_enough_to_act(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken-operate default operate\n")
    up = Up.start(tmp_path / "up", runners=1, extra={"RUNFLEET_API_TOKENS": str(tokens)})
    try:
        api, console = eventually(lambda: said(up), within=30, what="up's API and console lines")
        assert (api, console) == ("", "")
    finally:
        stop_cleanly(up)
