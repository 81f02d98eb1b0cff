"""The config file (cli/config_file.py): flag > environment > file > default, and every mistake
in the file reported as one line that names the file, with exit code 2."""

from __future__ import annotations

import pytest
from cli_helpers import run_cli


@pytest.fixture
def config(tmp_path, monkeypatch):
    """Write the XDG config file; returns its path."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "gptoss" / "config.toml"
    path.parent.mkdir()

    def write(text: str):
        path.write_text(text)
        return path

    return write


def _one_line_error(r, *fragments: str) -> None:
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1 and "hint:" in r.stderr
    for fragment in fragments:
        assert fragment in r.stderr, r.stderr


def test_file_sets_defaults_that_help_shows(config):
    config('[bench]\nbatch = [1, 4]\n')
    r = run_cli(["bench", "--help"])
    assert r.exit_code == 0 and "[default: 1,4]" in r.stdout


def test_flag_beats_environment_beats_file(config, monkeypatch):
    # bench validates --effort before it loads a model, and random:nope fails fast (exit 4) after.
    path = config('effort = "extreme"\n')
    from_file = run_cli(["bench", "-m", "random:nope"])
    _one_line_error(from_file, "'extreme'", f"effort in {path}", "pass --effort")
    monkeypatch.setenv("GPTOSS_EFFORT", "low")
    assert run_cli(["bench", "-m", "random:nope"]).exit_code == 4  # the environment's value won
    from_flag = run_cli(["bench", "-m", "random:nope", "--effort", "wrong"])
    assert from_flag.exit_code == 2 and "'wrong'" in from_flag.stderr
    assert str(path) not in from_flag.stderr  # the command line's own value: no pointer to the file


def test_table_beats_top_level(config):
    path = config('effort = "low"\n[bench]\neffort = "extreme"\n')
    _one_line_error(run_cli(["bench", "-m", "random:nope"]), f"[bench] effort in {path}")
    config('[bench]\neffort = "low"\n[chat]\neffort = "extreme"\n')
    assert run_cli(["bench", "-m", "random:nope"]).exit_code == 4


def test_value_rejected_by_the_option_points_at_the_file(config):
    path = config("[chat]\ntemperature = -1\n")
    r = run_cli(["chat", "-m", "random:nope", "hi"])
    assert r.exit_code == 2 and "--temperature" in r.stderr and f"[chat] temperature in {path}" in r.stderr


@pytest.mark.parametrize("text,fragment", [
    ("model = \n", "invalid TOML"),
    ("[chatt]\nseed = 1\n", "unknown table [chatt]"),
    ("[config]\nseed = 1\n", "unknown table [config]"),
    ("[chat]\nmax_token = 3\n", "[chat] max_token is not an option of gptoss chat"),
    ("bogus = 1\n", "bogus is not an option of any gptoss command"),
    ("[chat]\ntemperature = true\n", "[chat] temperature must be a string or a number"),
    ("[bench]\nignore-eos = 1\n", "[bench] ignore-eos must be true or false"),
    ("[bench]\nbatch = []\n", "[bench] batch must be a string, a number or a list"),
    ("debug = true\n", "debug is not an option"),
])
def test_mistakes_in_the_file_are_one_line_errors(config, text, fragment):
    path = config(text)
    _one_line_error(run_cli(["chat", "hi"]), fragment, str(path))


def test_explicit_config_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOSS_CONFIG", str(tmp_path / "missing.toml"))
    _one_line_error(run_cli(["chat", "hi"]), "missing.toml", "GPTOSS_CONFIG")


def test_config_path_and_show(config, tmp_path):
    r = run_cli(["config", "show"])
    assert r.exit_code == 0 and "no config file at" in r.stdout
    path = config('model = "random:tiny"\ncolor = "never"\n[download]\ninclude = "*.json"\n'
                  '[bench]\nbatch = [1, 64]\nignore_eos = false\n')
    r = run_cli(["config", "path"])
    assert r.exit_code == 0 and r.stdout.strip() == str(path)
    shown = run_cli(["config", "show"]).stdout.splitlines()
    assert shown[0] == f"# {path}" and shown[1] == 'color = "never"'
    start = shown.index("[bench]") + 1
    end = next((i for i in range(start, len(shown)) if shown[i].startswith("[")), len(shown))
    assert shown[start:end] == ['model = "random:tiny"', 'batch = "1,64"', "ignore-eos = false"]
    assert 'include = ["*.json"]' in shown and "[chat]" in shown and "[download]" in shown
    path.write_text("model = \n")  # broken: `config path` still answers, `config show` reports it
    assert run_cli(["config", "path"]).exit_code == 0
    _one_line_error(run_cli(["config", "show"]), "invalid TOML")


def test_positional_model_wins_over_model_from_environment_or_file(config, monkeypatch):
    # bench takes the model as an argument or as --model; only both typed is a conflict.
    config('model = "random:nope"\n')
    r = run_cli(["bench", "random:nope2"])
    assert r.exit_code == 4 and "random:nope2" in r.stderr and "two models" not in r.stderr
    monkeypatch.setenv("GPTOSS_MODEL", "random:nope3")
    r = run_cli(["bench", "random:nope2"])
    assert r.exit_code == 4 and "random:nope2" in r.stderr and "two models" not in r.stderr
    assert "two models" in run_cli(["bench", "random:nope2", "--model", "random:nope3"]).stderr


def test_global_config_flag_names_the_file(config, tmp_path, monkeypatch):
    # --config FILE before the command stands for GPTOSS_CONFIG=FILE during the run, and only then.
    config('effort = "low"\n')  # the XDG file, which --config replaces
    other = tmp_path / "other.toml"
    other.write_text('effort = "extreme"\n')
    r = run_cli(["--config", str(other), "bench", "-m", "random:nope"])
    _one_line_error(r, "'extreme'", f"effort in {other}")
    assert run_cli([f"--config={other}", "config", "path"]).stdout.strip() == str(other)
    assert run_cli(["bench", "-m", "random:nope"]).exit_code == 4  # the XDG file again
    missing = run_cli(["--config", str(tmp_path / "missing.toml"), "chat", "hi"])
    _one_line_error(missing, "missing.toml", "--config or GPTOSS_CONFIG")
    assert "config = " not in run_cli(["config", "show"]).stdout
    config('config = "x.toml"\n')  # a file cannot name another file
    _one_line_error(run_cli(["chat", "hi"]), "config is not an option")


def test_global_model_flag_is_the_default_model(config, monkeypatch):
    # --model before the command is the default of every command's -m (as GPTOSS_MODEL, which it
    # beats); the command's own -m wins; a top-level `model` key in the file still reaches commands.
    monkeypatch.setenv("GPTOSS_MODEL", "random:from-env")
    r = run_cli(["--model", "random:global", "chat", "hi"])
    assert r.exit_code == 4 and "random:global" in r.stderr
    r = run_cli(["--model", "random:global", "chat", "-m", "random:own", "hi"])
    assert r.exit_code == 4 and "random:own" in r.stderr
    import os

    assert os.environ["GPTOSS_MODEL"] == "random:from-env"  # restored after the in-process run
    monkeypatch.delenv("GPTOSS_MODEL")
    config('model = "random:from-file"\n')
    r = run_cli(["run", "-", "-o", "-"], input='{"prompt": "x"}\n')
    assert "random:from-file" in r.stderr
