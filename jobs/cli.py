"""The `clover-batch` command line: thin typer commands that each call one function.

Job commands (`validate`, `run`, `show`) live here; model commands (`model init`, `model inspect`, `generate`)
live in `jobs/model_cli.py` and are mounted below.
"""

from __future__ import annotations

import typer

from clover_batch.jobs.model_cli import register_model_commands

app = typer.Typer(help="Run the Clover diffusion MoE model over collections of documents.", no_args_is_help=True)
register_model_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
