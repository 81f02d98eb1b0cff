"""Bad input never crashes with a traceback: fuzzed JSONL lines and config.json files, a broken
checkpoint through the CLI, and no pickle anywhere in the package."""

import io
import json
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import run_cli
from gptoss_cli.cli.batch_input import RawLine, parse_line, read_raw_lines
from gptoss_cli.runtime.config import ModelConfig, load_generation_config, load_model_config
from gptoss_cli.runtime.errors import CheckpointError
from gptoss_cli.runtime.random_checkpoint import write_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src" / "gptoss_cli"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25)
line_keys = st.sampled_from(["custom_id", "method", "url", "body", "messages", "prompt", "developer", "text",
                             "role", "content", "temperature", "top_p", "max_tokens", "tools", "seed", "id"])
line_objects = st.dictionaries(line_keys | st.text(max_size=8), json_values, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | line_objects.map(lambda o: json.dumps(o).encode()))
def test_any_jsonl_line_becomes_a_request_or_an_error(data):
    (raw,) = list(read_raw_lines(io.BytesIO(data.replace(b"\n", b" ") + b"\n"))) or [RawLine(1, b"", 1)]
    line = parse_line(raw)
    if line is not None:
        assert (line.request is None) != (line.error is None)
        if line.error is not None:
            assert line.error.message and "\n" not in line.error.message


config_keys = st.sampled_from(list(ModelConfig.__dataclass_fields__) + ["rope_parameters", "num_experts"])


def _assert_loads_or_one_line_error(loader, path, data) -> None:
    """Write `data` as JSON to `path`; `loader(path)` must load it or raise a one-line CheckpointError
    (any other exception fails the test)."""
    path.write_text(json.dumps(data))
    try:
        loader(path)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(config_keys, json_values, max_size=8), st.booleans())
def test_config_loader_raises_only_checkpoint_errors(tmp_path_factory, fields, gpt_oss):
    data = {**fields, "model_type": "gpt_oss"} if gpt_oss else fields
    _assert_loads_or_one_line_error(load_model_config, tmp_path_factory.mktemp("cfg") / "config.json", data)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["eos_token_id", "pad_token_id", "bos_token_id", "temperature"]),
                       json_values, max_size=4))
def test_generation_config_loader_raises_only_checkpoint_errors(tmp_path_factory, fields):
    path = tmp_path_factory.mktemp("gen") / "generation_config.json"
    _assert_loads_or_one_line_error(load_generation_config, path, fields)


def test_truncated_checkpoint_through_the_cli(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1, tokenizer=False)
    (ckpt / "tokenizer.json").write_text("{}")
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-4096])
    r = run_cli(["chat", "--model", str(ckpt), "--no-history", "hi"])
    assert r.exit_code == 4 and "Traceback" not in r.stderr
    assert shard.name in r.stderr and "truncated" in r.stderr


def test_not_a_gpt_oss_directory_through_the_cli(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    r = run_cli(["run", "-", "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path)], input='{"prompt": "x"}\n')
    assert r.exit_code == 4 and "not a gpt-oss config" in r.stderr and "Traceback" not in r.stderr


def test_no_pickle_anywhere_in_the_package():
    pattern = re.compile(r"\bpickle\b|torch\.load\(|\.bin\b\"|from_pretrained\(")
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_old_gpu_is_refused_with_a_clear_message(monkeypatch):
    import pytest
    import torch

    from gptoss_cli.runtime.errors import HardwareError
    from gptoss_cli.runtime.gpu.preflight import check_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(HardwareError, match="Tesla T4 .compute capability 7.5. is not supported") as info:
        check_device(torch.device("cuda"))
    assert "8.0" in info.value.hint and info.value.exit_code == 4


def test_model_too_big_for_the_gpu_says_what_is_needed(monkeypatch):
    import pytest
    import torch

    from gptoss_cli.runtime.errors import HardwareError
    from gptoss_cli.runtime.gpu.preflight import check_weights_fit
    from gptoss_cli.runtime.random_checkpoint import random_config

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    check_weights_fit(random_config("20b"), torch.device("cuda"))  # 12.8 + 0.6 GiB + workspace fit in 40
    # 60.8 GiB of weights, 3.3 of fragment-order scales, 3 of workspace
    with pytest.raises(HardwareError, match=r"needs 67\.1 GiB .* 40\.0 of 80\.0 GiB are free"):
        check_weights_fit(random_config("120b"), torch.device("cuda"))


def test_split_copy_is_on_only_where_it_leaves_room(monkeypatch):
    import pytest
    import torch

    from gptoss_cli.runtime.errors import HardwareError
    from gptoss_cli.runtime.gpu.preflight import split_blocks_bytes, want_split_copy
    from gptoss_cli.runtime.random_checkpoint import random_config

    cuda, small, big = torch.device("cuda"), random_config("20b"), random_config("120b")
    assert 8.5 < split_blocks_bytes(small) / 2**30 < 9.5 and 50 < split_blocks_bytes(big) / 2**30 < 56
    free = {"now": 126 * 2**30}  # an H200 (140 GiB) after 20b's weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], 140 * 2**30))
    assert want_split_copy(small, cuda, None, 64) is True
    assert want_split_copy(small, cuda, None, 32) is True
    # batch decode never reaching the tiles (chat's batch 1, the grouped kernels up to 16): no copy
    assert want_split_copy(small, cuda, None, 1) is False and want_split_copy(small, cuda, None, 16) is False
    assert want_split_copy(small, cuda, True, 1) is True  # asked for
    assert want_split_copy(small, cuda, None, 64, torch.float32) is False  # only the bf16 asm reads it
    assert want_split_copy(big, cuda, None, 64) is False  # 38 % of the GPU
    assert want_split_copy(small, cuda, False, 64) is False
    free["now"] = 15 * 2**30  # 20b on a 24 GB card's worth of free memory: the KV cache keeps it
    assert want_split_copy(small, cuda, None, 64) is False
    with pytest.raises(HardwareError, match="split-word copy needs 8.9 GiB; 11.0 GiB are free") as info:
        free["now"] = 11 * 2**30
        want_split_copy(small, cuda, True, 64)
    assert "moe_split_copy" in info.value.hint
    assert want_split_copy(small, torch.device("cpu"), None, 64) is False


def test_kv_cache_too_small_says_which_context_fits():
    import pytest

    from gptoss_cli.runtime.errors import HardwareError
    from gptoss_cli.runtime.gpu.kv_cache import plan_kv_memory
    from gptoss_cli.runtime.random_checkpoint import random_config

    cfg = random_config("20b")
    plan = plan_kv_memory(cfg, 8 * 2**30, 64, 131072, 64, 8192)
    assert plan.full_blocks > 131072 // 64
    with pytest.raises(HardwareError) as info:
        plan_kv_memory(cfg, 2 * 2**30, 64, 131072, 64, 8192)
    assert "131072 requested" in str(info.value) and "--context" in info.value.hint
