"""The options every command of the command line takes: ``-v/--verbose``."""

from __future__ import annotations

import click


def _set_verbose(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta["qatune.verbose"] = True


verbose_option = click.option(
    "-v", "--verbose", is_flag=True, expose_value=False, is_eager=True, callback=_set_verbose,
    help="Show debug logs and full tracebacks.",
)
