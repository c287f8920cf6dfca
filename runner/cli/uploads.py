"""`runfleet upload FILE` and the parsing of `launch --attach` (SPEC §8, §10)."""

from __future__ import annotations

from pathlib import Path

import click

from runner.cli.runtime import command, json_option
from runner.cli.views import echo_json
from runner.operations import open_env
from runner.operations import uploads as upload_ops

UPLOAD_PREFIX = "upload:"


def parse_attach(values: tuple[str, ...]) -> tuple[dict[str, Path], dict[str, str]]:
    """`--attach name=PATH` and `--attach name=upload:ID` → (name → path, name → upload id)."""
    paths: dict[str, Path] = {}
    uploads: dict[str, str] = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep or not name or not target:
            raise click.UsageError(f"--attach expects name=PATH or name=upload:ID, got {value!r}")
        if name in paths or name in uploads:
            raise click.UsageError(f"--attach names {name!r} twice")
        if target.startswith(UPLOAD_PREFIX):
            uploads[name] = target.removeprefix(UPLOAD_PREFIX)
            continue
        path = Path(target)
        if not path.is_file():
            raise click.UsageError(f"--attach {name}={target}: no such file")
        paths[name] = path
    return paths, uploads


@click.command("upload")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@command
async def upload_cmd(file: Path, as_json: bool) -> None:
    """Stage FILE for a later launch (`--attach name=upload:ID`) and print its upload id.

    \b
    Example:
      runfleet upload spec.pdf
      runfleet launch review.yaml --attach spec=upload:<id>
    """
    async with open_env() as env:
        staged = await upload_ops.upload(env, file)
    if as_json:
        echo_json(
            {
                "upload_id": staged.id,
                "files": [f.model_dump(exclude={"key", "name"}) for f in staged.files],
            }
        )
    else:
        click.echo(staged.id)
