"""Option declarations shared by chat, run and bench (declared once, with help text).

Sampling defaults follow OpenAI's recommendation for gpt-oss: temperature 1.0, top-p 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

MODEL_NAMES = ("20b", "120b", "random:tiny", "random:20b", "random:120b")
EFFORTS = ("low", "medium", "high")
DEFAULT_EFFORT = "medium"
REASONING_MODES = ("show", "collapse", "hide")  # chat's reasoning display


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of -m: the model names, and directories once the word looks like a path."""
    names = [n for n in MODEL_NAMES if n.startswith(incomplete)]
    if incomplete.startswith((".", "/", "~")) or "/" in incomplete:
        base = Path(incomplete).expanduser()
        folder, stem = (base, "") if incomplete.endswith("/") else (base.parent, base.name)
        try:
            names += sorted(incomplete[: len(incomplete) - len(stem)] + p.name + "/"
                            for p in folder.iterdir() if p.is_dir() and p.name.startswith(stem))
        except OSError:
            pass
    return names


def complete_choices(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of an option that takes one of `choices`."""
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]


ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", envvar="GPTOSS_MODEL", show_envvar=True, autocompletion=complete_model,
    help="20b, 120b, a checkpoint directory, or random:tiny|random:20b|random:120b (random weights, no download).")]
EffortOpt = Annotated[str, typer.Option(
    "--effort", envvar="GPTOSS_EFFORT", autocompletion=complete_choices(EFFORTS),
    help="Reasoning effort: low, medium or high.")]
TemperatureOpt = Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.", min=0.0)]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].", min=0.0, max=1.0)]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the K most likely tokens; 0 = off.", min=0)]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the top probability.",
                                        min=0.0, max=1.0)]
RepetitionPenaltyOpt = Annotated[float, typer.Option(
    "--repetition-penalty", help="Above 1, make tokens already in the prompt or the output less likely (vLLM's "
                                 "rule: a seen token's logit is divided by R if positive, multiplied if not); "
                                 "1 = off.")]
SeedOpt = Annotated[int | None, typer.Option(help="Random seed (per request); unset = random.", min=0)]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "--max-tokens", "-n", help="Most tokens to generate, reasoning included; unset = up to the context.", min=1)]
StopOpt = Annotated[list[str] | None, typer.Option(
    "--stop", help="End the answer where this text first appears (the text is not kept); repeatable, up to 4. "
                   "Reasoning is not matched.")]
ContextOpt = Annotated[int | None, typer.Option(
    "--context", "-c", help="Context length in tokens (prompt + output); default: the model's 131072.", min=16)]

def option_typed(ctx: typer.Context, name: str, env: bool = False) -> bool:
    """Whether the user gave option `name`: on the command line, or with `env` also through its
    environment variable (not the config file or the default)."""
    source = ctx.get_parameter_source(name)
    # Compared by name: typer may vendor its own copy of click's ParameterSource.
    return source is not None and source.name in (("COMMANDLINE", "ENVIRONMENT") if env else ("COMMANDLINE",))


def check_stop(stop: list[str] | None) -> tuple[str, ...]:
    """Validate --stop (at most 4 non-empty strings)."""
    from ..runtime.stop_strings import check_stops  # the runtime stays unloaded for --help

    try:
        return check_stops(stop or ())
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--stop") from None


def flag_message(message: str) -> str:
    """A settings error that starts with a field's name (SamplingParams' messages), with the
    command-line flag instead: "top_p must be ..." -> "--top-p must be ..."."""
    field = message.split(" ", 1)[0]
    return f"--{field.replace('_', '-')}{message[len(field):]}" if field.isidentifier() else message


def check_effort(effort: str) -> str:
    """Validate --effort / GPTOSS_EFFORT (typer cannot express a choice with an env default)."""
    if effort not in EFFORTS:
        raise typer.BadParameter(f"{effort!r} is not one of {', '.join(EFFORTS)}", param_hint="--effort")
    return effort
