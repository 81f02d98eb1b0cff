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


def _complete(words: str, cword: int) -> list[str]:
    """What bash completion offers for COMP_WORDS / COMP_CWORD (Typer's completion protocol)."""
    import os

    env = {**os.environ, "_GPTOSS_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    proc = subprocess.run([sys.executable, "-c", "from gptoss_cli.cli import main; main()"], env=env, check=False,
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.split()


def test_shell_completion_of_models_choices_and_folders(tmp_path):
    assert _complete("gptoss chat --effort ", 3) == ["low", "medium", "high"]
    assert _complete("gptoss chat -m random:", 3) == ["random:tiny", "random:20b", "random:120b"]
    assert _complete("gptoss chat --reasoning c", 3) == ["collapse"]
    assert _complete("gptoss --color n", 2) == ["never"]
    (tmp_path / "ckpt-a").mkdir()
    (tmp_path / "ckpt-b").mkdir()
    (tmp_path / "ckpt-file").write_text("x")
    assert _complete(f"gptoss bench -m {tmp_path}/ck", 3) == [f"{tmp_path}/ckpt-a/", f"{tmp_path}/ckpt-b/"]
