"""The `gptoss` command line: download, chat, run, bench, config, models.

`main()` runs the Typer app and turns every failure into one line plus a documented exit code
(see errors.py). Command modules are imported here so they register on the app.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager

from rich.markup import escape

from . import config_file, errors
from .app import app
from .console import make_ui

# Command modules register themselves on `app` when imported.
from . import download as _download  # noqa: E402,F401
from . import run as _run  # noqa: E402,F401
from . import chat as _chat  # noqa: E402,F401
from . import bench as _bench  # noqa: E402,F401
from . import config_cmd as _config_cmd  # noqa: E402,F401
from . import list_models as _list_models  # noqa: E402,F401


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("GPTOSS_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns (and exits with) the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    code = _invoke(args)
    if argv is None:
        sys.exit(code)
    return code


def _click_exceptions():
    """(Exit, Abort, ClickException) classes from every click the app may raise them from: newer
    typer vendors click (typer._click, typer.exceptions), older typer uses the click package."""
    import importlib

    modules = []
    for name in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    return tuple(tuple({getattr(m, cls) for m in modules if hasattr(m, cls)})
                 for cls in ("Exit", "Abort", "ClickException"))


def _invoke(args: list[str]) -> int:
    """The global --config and --model stand for GPTOSS_CONFIG and GPTOSS_MODEL during this run
    (so a command's own -m, and flags generally, still win over them)."""
    with _scoped_env("GPTOSS_CONFIG", config_file.global_value(args, "--config")), \
            _scoped_env("GPTOSS_MODEL", config_file.global_value(args, "--model")):
        return _invoke_command(args)


@contextmanager
def _scoped_env(name: str, value: str | None):
    """os.environ[name] = value for the block (nothing when value is None), then as it was: a
    global flag that stands for an environment variable (--config for GPTOSS_CONFIG, --model for
    GPTOSS_MODEL) must not outlive its run when main() is called in-process."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _invoke_command(args: list[str]) -> int:
    from ..runtime.errors import GptossError

    exit_types, abort_types, click_errors = _click_exceptions()
    command = typer_command()
    settings = None
    try:
        # `gptoss config` reports on the file itself, so a broken one must not stop it here.
        if config_file.command_name(args) != "config":
            settings = config_file.load(command)
        result = command.main(args=args, prog_name="gptoss", standalone_mode=False,
                              default_map=settings.default_map if settings else None)
        return result if isinstance(result, int) else errors.OK
    except exit_types as e:
        return e.exit_code
    except abort_types:
        return errors.INTERRUPTED
    except click_errors as e:
        e.show()
        hint = config_file.value_hint(settings, command, args, _flag(getattr(e, "param_hint", None)),
                                      getattr(e, "param", None))
        if hint:
            make_ui().err.print(f"[dim]hint: {escape(hint)}[/]", soft_wrap=True)
        return errors.USAGE
    except errors.UsageError as e:
        flag = _flag(str(e))
        make_ui().error(str(e), config_file.value_hint(settings, command, args, flag) or e.hint)
        return errors.USAGE
    except GptossError as e:
        _report(args, str(e), e.hint)
        return e.exit_code
    except KeyboardInterrupt:
        make_ui().err.print("[dim]interrupted[/]")
        return errors.INTERRUPTED
    except BrokenPipeError:
        return errors.OK
    except Exception as e:  # noqa: BLE001 - the last line of defence for the user
        _report(args, f"internal error: {type(e).__name__}: {e}", "run again with --debug and report the traceback")
        return errors.ERROR


def _flag(text) -> str | None:
    """The option an error message or click param hint starts with ("--effort: ...", "effort must
    be ...", "'--color'") as "--effort"; config_file.value_hint ignores words that name no option."""
    words = text.replace(":", " ").split() if isinstance(text, str) else []
    word = words[0].strip("'\"").split("/")[0].lstrip("-") if words else ""
    return f"--{word}" if word.replace("-", "").replace("_", "").isalpha() else None


def _report(args: list[str], message: str, hint: str) -> None:
    if _debug_requested(args):
        traceback.print_exc()
    make_ui().error(message, hint)


def typer_command():
    import typer.main

    return typer.main.get_command(app)
