"""`runfleet`: the operator CLI (SPEC §10). Every command takes `--json`.

The commands live by subject: `runs.py` (a run's life), `fleet.py` (processes and upkeep),
`dlq.py` (dead letters); this module only assembles them.
"""

from __future__ import annotations

import os

import click

from runner import fleet_settings
from runner.cli import fleet, runs
from runner.cli.console import console_cmd
from runner.cli.dlq import dlq_group
from runner.cli.uploads import upload_cmd
from runner.cli.validate import validate_cmd
from store.settings import record_taken

NOT_ADOPTING = frozenset({"up", "validate"})
"""`up` is the fleet whose settings the others adopt; `validate` reads no setting."""


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from runner.build import describe  # only `--version` pays for the source digest

    click.echo(f"runfleet, version {describe()}")
    ctx.exit()


@click.group()
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version, the build (a digest of the sources) and the commit, and exit.",
)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """runfleet: durable workflow runs on a fleet of runners fed by NATS JetStream.

    Settings come from RUNFLEET_* variables; RUNFLEET_DATA (default ./.runfleet) holds the
    embedded default's SQLite store and blobs. A command that finds a `runfleet up` fleet there
    uses the settings that fleet runs with, for each variable its own shell does not set.
    """
    if ctx.invoked_subcommand not in NOT_ADOPTING:
        taken = fleet_settings.adopt(
            os.environ, warn=lambda m: click.echo(f"warning: {m}", err=True)
        )
        record_taken(taken, str(fleet_settings.settings_path(os.environ).resolve()))


for _command in (
    runs.run_cmd,
    validate_cmd,
    upload_cmd,
    runs.launch_cmd,
    runs.resume_cmd,
    runs.cancel_cmd,
    runs.status_cmd,
    runs.runs_cmd,
    runs.events_cmd,
    runs.rewind_cmd,
    fleet.up_cmd,
    fleet.runner_cmd,
    fleet.sweep_cmd,
    fleet.streams_group,
    fleet.gc_cmd,
    dlq_group,
    console_cmd,
):
    cli.add_command(_command)
