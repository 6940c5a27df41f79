"""``python -m ddtree.server [flags]``: the same as ``ddtree serve [flags]``."""

from __future__ import annotations

import typer

from ddtree.errors import DDTreeError
from ddtree.server.cli import register


def main() -> None:
    """Like ``ddtree.cli.main``: a bad flag is a one-line message and exit code 2, not a traceback."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    try:
        app(prog_name="python -m ddtree.server")
    except DDTreeError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
