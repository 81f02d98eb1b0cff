"""Run the real `gptoss` entry point in-process with captured stdout/stderr and exit code."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from click.testing import CliRunner

from gptoss_cli.cli import main


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(args: list[str], input: str | bytes | None = None, env: dict[str, str] | None = None) -> CliResult:
    """`gptoss ARGS` through main(): the same error mapping and exit codes users get."""
    runner = CliRunner()
    with runner.isolation(input=input, env=env) as (out, err, _):
        code = main(list(args))
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return CliResult(code, stdout, stderr)
