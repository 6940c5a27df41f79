"""The ``ddtree`` command line: one typer app; each part registers its own commands.

Each part owns a ``cli`` module with ``register(app: typer.Typer) -> None`` so the commands live next to the code
they drive and this file stays a table of contents.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="ddtree",
    help="Lossless tree speculative decoding (DDTree + DFlash) and the lab that tunes it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules exposing ``register(app)``; listed here so the help output has a stable order.
_PARTS: tuple[str, ...] = (
    "ddtree.engine.cli",  # generate
    "ddtree.server.cli",  # serve
    "ddtree.lab.cli",  # bench, eval humaneval, sweep, report, replay
    "ddtree.train.cli",  # train tokenizer|target|drafter
    "ddtree.models.cli",  # standin
)

for _module in _PARTS:
    importlib.import_module(_module).register(app)


@app.command()
def version() -> None:
    """Print the ddtree, torch and transformers versions."""
    import torch
    import transformers

    from ddtree import __version__

    typer.echo(f"ddtree {__version__}  torch {torch.__version__}  transformers {transformers.__version__}")


def main() -> None:
    """Console-script entry point: turns DDTreeError into a one-line message and exit code 2."""
    from ddtree.errors import DDTreeError

    try:
        app()
    except DDTreeError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from None
