"""Model commands of the CLI: `model init`, `model inspect`, `generate`."""

from __future__ import annotations

import typer

model_app = typer.Typer(help="Create and inspect checkpoints.", no_args_is_help=True)


def register_model_commands(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
