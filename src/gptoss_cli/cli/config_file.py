"""The user's config file: defaults for the commands' options, below flags and environment variables.

Where: $GPTOSS_CONFIG if set (then it must exist), else $XDG_CONFIG_HOME/gptoss/config.toml
(~/.config/gptoss/config.toml); no file means no settings. TOML: a top-level key sets that option
for every command that has it (`model`, `effort`, `temperature`, ...; `color` is the global
--color), a [download] / [run] / [chat] / [bench] table sets one command's and wins over the
top level. Keys are the long flag names without the dashes (`max-tokens` or `max_tokens`).
The settings become click's default_map, so the order is: flag > environment variable > config
file > built-in default, and `--help` shows the defaults the file sets.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

# Options a file must not set: they act before any command (help, version, completion) or only
# as a flag on the command line (--debug is read from argv).
NOT_SETTABLE = frozenset({"help", "version", "install_completion", "show_completion", "debug", "config"})
# The global --model stands for GPTOSS_MODEL (cli/__init__.py); a top-level `model` key keeps
# meaning every command's -m.
COMMAND_ONLY = frozenset({"model"})
FIX_HINT = "fix the file, or point GPTOSS_CONFIG at another one"


def config_path() -> Path:
    """$GPTOSS_CONFIG (which the global --config sets for its run), else the XDG location."""
    explicit = os.environ.get("GPTOSS_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gptoss" / "config.toml"


@dataclass
class Settings:
    """A loaded file: click's default_map (global option names at the top, then one table per
    command) and, for each value, the key as the file wrote it."""

    path: Path
    default_map: dict = field(default_factory=dict)
    origin: dict = field(default_factory=dict)  # (command or "", param name) -> "[chat] max-tokens"

    def source_of(self, command: str, param: str) -> str | None:
        """Where the file sets `param` of `command` ("" = the global options), or None."""
        return self.origin.get((command, param))


def load(group) -> Settings | None:
    """The config file checked against the click group's commands; None when there is none."""
    path = config_path()
    if not path.is_file():
        if os.environ.get("GPTOSS_CONFIG"):
            raise UsageError(f"config file {path} (--config or GPTOSS_CONFIG) does not exist",
                             "create it, or name another file")
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: invalid TOML: {e}", FIX_HINT) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read config file {path}: {e}", FIX_HINT) from None
    settings = Settings(path)
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    for key, value in data.items():  # the top level first, so the tables win whatever the order
        if key not in tables:
            _set_everywhere(settings, group, key, value)
    for name, table in tables.items():
        if name not in group.commands or not settable_options(group.commands[name]):
            known = sorted(c for c, command in group.commands.items() if settable_options(command))
            raise UsageError(f"{path}: unknown table [{name}]", f"tables: {', '.join(f'[{c}]' for c in known)}")
        options = settable_options(group.commands[name])
        for key, value in table.items():
            param = options.get(_normal(key))
            if param is None:
                raise UsageError(f"{path}: [{name}] {key} is not an option of gptoss {name}",
                                 f"options: {', '.join(sorted(_flag_names(options)))}")
            _set(settings, name, param, f"[{name}] {key}", value)
    return settings


def settable_options(command) -> dict:
    """The command's options a file may set, by every spelling of their key: the parameter name
    and the long flags without dashes, with - and _ alike."""
    keys = {}
    for param in command.params:
        if param.param_type_name != "option" or param.name in NOT_SETTABLE:
            continue
        keys[_normal(param.name)] = param
        for flag in param.opts:
            if flag.startswith("--"):
                keys[_normal(flag[2:])] = param
    return keys


def _flag_names(options: dict) -> set[str]:
    return {next((f[2:] for f in p.opts if f.startswith("--")), p.name) for p in options.values()}


def _normal(key: str) -> str:
    return key.replace("-", "_")


def _set_everywhere(settings: Settings, group, key: str, value) -> None:
    """A top-level key: the global option of that name, else that option of every command."""
    norm = _normal(key)
    param = settable_options(group).get(norm)
    if param is not None and param.name not in COMMAND_ONLY:
        _set(settings, "", param, key, value)
        return
    found = False
    for name, command in group.commands.items():
        param = settable_options(command).get(norm)
        if param is not None:
            _set(settings, name, param, key, value)
            found = True
    if not found:
        raise UsageError(f"{settings.path}: {key} is not an option of any gptoss command",
                         "put command options in a table such as [chat], or check the spelling")


def _set(settings: Settings, command: str, param, where: str, value) -> None:
    target = settings.default_map if not command else settings.default_map.setdefault(command, {})
    target[param.name] = _checked_value(settings.path, where, param, value)
    settings.origin[(command, param.name)] = where


def _checked_value(path: Path, where: str, param, value):
    """The value in the form click takes for the option; the shape checked here, the value itself
    by the option's own parser (which names the option)."""
    def wrong(expected: str) -> UsageError:
        return UsageError(f"{path}: {where} must be {expected}, got {value!r}", FIX_HINT)

    if getattr(param, "is_flag", False):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    scalars = (str, int, float)
    if isinstance(value, list):
        if not value or not all(isinstance(v, scalars) and not isinstance(v, bool) for v in value):
            raise wrong("a string, a number or a list of them")
        items = [str(v) for v in value]
        return items if param.multiple else ",".join(items)  # e.g. bench batch = [1, 64] -> "1,64"
    if isinstance(value, bool) or not isinstance(value, scalars):
        raise wrong("a string or a number")
    return [str(value)] if param.multiple else value


# Global options that take a value as the next word (`--color never`).
_GLOBAL_VALUES = ("--color", "--model", "--config")


def _global_words(args: list[str]) -> list[str]:
    """The argv words before the subcommand's name."""
    i = 0
    while i < len(args):
        if args[i] in _GLOBAL_VALUES:
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            break
    return args[:i]


def command_name(args: list[str]) -> str | None:
    """The subcommand an argv names (skipping the global options' values), or None."""
    rest = args[len(_global_words(args)):]
    return rest[0] if rest else None


def global_value(args: list[str], flag: str) -> str | None:
    """The value of a global option (`--config FILE` or `--config=FILE`) given before the
    subcommand, or None. --config is read before click parses anything, because the file's
    settings become the defaults click parses with."""
    words = _global_words(args)
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def value_hint(settings: Settings | None, group, args: list[str], flag: str | None, param=None) -> str | None:
    """For an invalid option value: where the file set it, unless the command line did (then the
    value is the user's own). `flag` ("--effort") or the click `param` name the option."""
    if settings is None:
        return None
    name = command_name(args) or ""
    command = group.commands.get(name) if name else group
    if param is None and flag and command is not None:
        param = settable_options(command).get(_normal(flag.lstrip("-")))
        if param is None and name:  # a global option named after the command's error
            name, param = "", settable_options(group).get(_normal(flag.lstrip("-")))
    if param is None:
        return None
    where = settings.source_of(name, param.name) or settings.source_of("", param.name)
    given = any(a == f or a.startswith(f + "=") for a in args for f in [*param.opts, *param.secondary_opts])
    if where is None or given:
        return None
    return f"the value comes from {where} in {settings.path}; fix it there or pass {param.opts[0]}"
