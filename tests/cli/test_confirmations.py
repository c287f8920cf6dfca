"""A destructive command asks first (SPEC §10: `dlq purge … --yes`, `gc`); a no, or no terminal
to ask on, is the refusal `not_confirmed` (exit 3, the `--json` error object) with nothing
removed — never click's bare "Aborted!" with exit 1, which reads as a crash. The DLQ purge's
case is in `test_dlq_cli.py`."""

from __future__ import annotations

import json
import subprocess

from tests.cli.conftest import Up, eventually


def test_gc_without_yes_and_no_terminal_is_refused_not_confirmed_and_deletes_nothing(
    fleet: Up,
) -> None:
    run_id = fleet.ok("run", "examples/hello.yaml")["run_id"]

    def asked() -> subprocess.CompletedProcess[str] | None:
        # Until the run is a second old, gc plans nothing and has nothing to ask.
        result = fleet.cli("gc", "--older-than", "1s", "--json")
        return result if result.returncode != 0 else None

    result = eventually(asked, within=30.0)

    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "[y/N]" in result.stderr  # it asked first
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["message"]) == ("not_confirmed", "not confirmed: nothing deleted")
    assert "--yes" in error["remedy"]
    assert fleet.status(run_id)["status"] == "finished"
