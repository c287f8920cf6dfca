"""`python -m runner …` is `runfleet …` (used by `runfleet up` to start runner processes)."""

from runner.cli.main import cli

cli()
