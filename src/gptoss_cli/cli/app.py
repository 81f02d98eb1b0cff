"""The Typer application and its global options; commands register themselves on `app`.

Nothing heavy is imported here: torch and the runtime load inside command bodies, so
`gptoss --help` is instant and works without a GPU.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from .console import COLOR_CHOICES, make_ui
from .options import complete_choices

app = typer.Typer(
    name="gptoss",
    help="Run OpenAI's gpt-oss-20b and gpt-oss-120b on one GPU (or the CPU): download, chat, run, bench.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"gptoss {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(
        "--model", show_default=False,
        help="Default model of chat, run and bench (as GPTOSS_MODEL); their own -m wins.")] = None,
    color: Annotated[str, typer.Option(help="Colour output: auto, always or never.", envvar="GPTOSS_COLOR",
                                       autocompletion=complete_choices(COLOR_CHOICES))] = "auto",
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="chat: after each reply, a timing block on stderr (ollama's --verbose, with the "
                          "prefix-cache and reasoning counts).")] = False,
    config: Annotated[str | None, typer.Option(
        "--config", show_default=False, help="Config file to read (must exist) instead of GPTOSS_CONFIG or "
                                             "~/.config/gptoss/config.toml.")] = None,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Global options. --model and --config act before parsing (cli/__init__.py: they stand for
    GPTOSS_MODEL and GPTOSS_CONFIG during the run), so they are not used here."""
    if color not in COLOR_CHOICES:
        raise typer.BadParameter(f"must be one of {', '.join(COLOR_CHOICES)}", param_hint="--color")
    ctx.obj = make_ui(color, debug, verbose)
