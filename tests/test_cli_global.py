"""Global CLI behaviour: help without torch, version, usage errors exit 2, --debug tracebacks."""

import subprocess
import sys

from cli_helpers import run_cli


def test_help_is_fast_and_does_not_import_torch():
    code = "import sys; from gptoss_cli.cli import main; main(['--help']) ; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "download" in proc.stdout and proc.stdout.strip().endswith("False")


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "gptoss_cli", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("gptoss ")


def test_version():
    r = run_cli(["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("gptoss ")


def test_usage_errors_exit_2():
    assert run_cli(["nosuchcommand"]).exit_code == 2
    assert run_cli(["--color", "purple", "run", "x.jsonl", "-o", "y.jsonl"]).exit_code == 2
    assert run_cli(["bench", "--input-len", "0"]).exit_code == 2


def test_missing_model_is_one_line_with_hint(tmp_path):
    r = run_cli(["chat", "--model", str(tmp_path / "nope"), "hi"])
    assert r.exit_code == 4
    assert "Traceback" not in r.stderr and "error:" in r.stderr and "hint:" in r.stderr


def test_debug_shows_traceback(tmp_path):
    r = run_cli(["--debug", "chat", "--model", str(tmp_path / "nope"), "hi"])
    assert r.exit_code == 4 and "Traceback" in r.stderr
