"""`gptoss config path|show`: where the config file is, and what it sets for each command."""

from __future__ import annotations

import json

import typer

from . import config_file
from .app import app

config_app = typer.Typer(help="The config file: where it is (path) and what it sets (show).", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("path")
def path() -> None:
    """Print where gptoss looks for its config file ($GPTOSS_CONFIG, else the XDG config dir)."""
    print(config_file.config_path())


@config_app.command("show")
def show() -> None:
    """Print the settings the config file gives each command (flags and environment variables
    still win over them), or where to create one."""
    import typer.main

    group = typer.main.get_command(app)
    settings = config_file.load(group)
    if settings is None:
        print(f"# no config file at {config_file.config_path()}: create it to set defaults, e.g.")
        print('# model = "120b"\n# [chat]\n# temperature = 0.7')
        return
    print(f"# {settings.path}")
    for name, value in settings.default_map.items():
        if not isinstance(value, dict):
            print(f"{_key(group, name)} = {_toml(value)}")
    for command, table in settings.default_map.items():
        if isinstance(table, dict):
            print(f"[{command}]")
            for name, value in table.items():
                print(f"{_key(group.commands[command], name)} = {_toml(value)}")


def _key(command, param_name: str) -> str:
    """The option's long flag without dashes (the spelling `gptoss CMD --help` shows)."""
    param = next(p for p in command.params if p.name == param_name)
    return next((f[2:] for f in param.opts if f.startswith("--")), param_name)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else str(value)
