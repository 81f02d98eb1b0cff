"""Checkpoint loader: a good random checkpoint round-trips; every bad-checkpoint case fails
with a one-line CheckpointError that names the file (and tensor where there is one)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_cli.runtime.checkpoint import INDEX_FILE, expected_tensors, load_checkpoint
from gptoss_cli.runtime.config import ModelConfig
from gptoss_cli.runtime.errors import CheckpointError
from gptoss_cli.runtime.model_ref import ReferenceModel
from gptoss_cli.runtime.random_checkpoint import (
    build_random_weights,
    random_weights,
    successor_permutation,
    write_checkpoint,
)

MINI = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture
def ckpt(tmp_path):
    d = write_checkpoint(tmp_path / "ckpt", "mini", seed=3, config=MINI, max_shard_bytes=150_000, tokenizer=False)
    (d / "tokenizer.json").write_text("{}")
    return d


def _shards(d):
    return sorted(d.glob("*.safetensors"))


def _error(d) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d)
    message = str(info.value)
    assert "\n" not in message and info.value.hint
    return message


def test_round_trip_keeps_packed_experts_and_dtypes(ckpt):
    w = load_checkpoint(ckpt)
    assert len(_shards(ckpt)) > 1
    assert w.config == MINI
    assert set(w.tensors) == set(expected_tensors(MINI))
    blocks = w.layer(1, "mlp.experts.gate_up_proj_blocks")
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 128, 2, 16)
    assert w.layer(0, "self_attn.q_proj.weight").dtype == torch.bfloat16
    for shard in _shards(ckpt):
        for name, t in load_file(shard).items():
            assert torch.equal(w.tensors[name], t), name


def test_random_checkpoint_is_seeded(ckpt, tmp_path):
    again = write_checkpoint(tmp_path / "again", "mini", seed=3, config=MINI, tokenizer=False)
    other = write_checkpoint(tmp_path / "other", "mini", seed=4, config=MINI, tokenizer=False)
    a, b, c = (load_file(next(iter(_shards(d)))) for d in (ckpt, again, other))
    name = "model.embed_tokens.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


@pytest.fixture(scope="module")
def tiny():
    return random_weights("tiny", seed=0, confident=True)


def test_in_memory_random_tiny_matches_schema(tiny):
    for name, spec in expected_tensors(tiny.config).items():
        assert tuple(tiny.tensors[name].shape) == spec.shape, name


def test_confident_readout_is_opt_in(tiny):
    """Only the lm_head differs; the default keeps the Gaussian readout the token-equality tests need."""
    plain = random_weights("tiny", seed=0)
    for name, t in plain.tensors.items():
        assert torch.equal(t, tiny.tensors[name]) == (name != "lm_head.weight"), name


def test_lm_head_puts_the_successor_on_top(tiny):
    """A hidden state along token t's embedding (rms 1, as after the final norm) reads out
    successor(t) clearly above every other token (the old Gaussian lm_head gave a random argmax
    with a ~0.2 sd gap)."""
    embed, head = tiny.tensors["model.embed_tokens.weight"].float(), tiny.tensors["lm_head.weight"].float()
    tokens = torch.randint(0, 201088, (64,), generator=torch.Generator().manual_seed(0))
    h = embed[tokens] / embed[tokens].pow(2).mean(-1, keepdim=True).sqrt()
    top = (h @ head.T).topk(2, dim=-1)
    assert torch.equal(top.indices[:, 0], successor_permutation(201088, seed=0)[tokens])
    assert (top.values[:, 0] - top.values[:, 1]).min() > 2.0


def test_reference_greedy_is_confident_and_bf16_agrees(tiny):
    """Through the whole model: the greedy token stands > 1 logit sd above the runner-up, so
    bf16 and fp32 references decode the same 16 greedy tokens."""
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = ReferenceModel(tiny, dtype=dtype)
        prompts = [torch.randint(0, 199998, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (1, 40, 150)]
        caches = [m.new_cache() for _ in prompts]
        logits = m.forward([(p, c) for p, c in zip(prompts, caches)])
        out = []
        for _ in range(16):
            top = logits.topk(2, dim=-1)
            if dtype == torch.float32:
                assert ((top.values[:, 0] - top.values[:, 1]) / logits.std(-1)).min() > 1.0
                assert torch.isfinite(logits).all()
            out.append(top.indices[:, 0])
            logits = m.forward([([t], c) for t, c in zip(top.indices[:, 0].tolist(), caches)])
        outs[dtype] = torch.stack(out)
    assert torch.equal(outs[torch.float32], outs[torch.bfloat16])


def test_lm_head_shard_equals_in_memory(tmp_path):
    """The confident lm_head regenerates the embedding it needs, so its shard alone reproduces it."""
    d = write_checkpoint(tmp_path / "c", "mini", seed=3, config=MINI, max_shard_bytes=150_000, tokenizer=False,
                         confident=True)
    (d / "tokenizer.json").write_text("{}")
    w = build_random_weights(MINI, seed=3, confident=True)
    name = "lm_head.weight"
    assert torch.equal(load_checkpoint(d).tensors[name], w.tensors[name])
    assert not torch.equal(w.tensors[name], build_random_weights(MINI, seed=4, confident=True).tensors[name])


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in _error(f)
    assert "no such directory" in _error(tmp_path / "missing")


def test_no_config_and_original_only(tmp_path):
    assert "no config.json" in _error(tmp_path)
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "config.json").write_text("{}")
    assert "original/" in _error(tmp_path)


def test_not_gpt_oss_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert "not a gpt-oss config" in _error(ckpt)
    (ckpt / "config.json").write_text("{not json")
    assert "not valid JSON" in _error(ckpt)


def test_missing_tokenizer(ckpt):
    os.remove(ckpt / "tokenizer.json")
    assert "tokenizer.json" in _error(ckpt)


def test_missing_shard(ckpt):
    victim = _shards(ckpt)[-1]
    victim.unlink()
    msg = _error(ckpt)
    assert victim.name in msg and "missing" in msg


def test_missing_shard_without_index_names_tensor(ckpt):
    os.remove(ckpt / INDEX_FILE)
    _shards(ckpt)[0].unlink()
    assert "model.embed_tokens.weight is missing" in _error(ckpt)


def test_truncated_shard(ckpt):
    victim = _shards(ckpt)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    msg = _error(ckpt)
    assert victim.name in msg and "truncated" in msg
    victim.write_bytes(data[:5])
    assert "truncated" in _error(ckpt)


def test_corrupted_header(ckpt):
    victim = _shards(ckpt)[0]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"\xff" * 12
    victim.write_bytes(bytes(data))
    assert "corrupted" in _error(ckpt)


def _rewrite(shard, edit):
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)


def _shard_of(ckpt, name):
    return ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"][name]


def test_wrong_dtype(ckpt):
    name = "model.layers.1.self_attn.sinks"
    _rewrite(_shard_of(ckpt, name), lambda t: t.update({name: t[name].to(torch.int32)}))
    msg = _error(ckpt)
    assert name in msg and "dtype I32" in msg
    name = "model.layers.0.mlp.experts.down_proj_scales"
    _rewrite(_shard_of(ckpt, name), lambda t: t.update({name: t[name].float()}))
    assert name in _error(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(_shard_of(ckpt, name), lambda t: t.update({name: t[name][:8].contiguous()}))
    msg = _error(ckpt)
    assert name in msg and "shape [8, 64]" in msg


def test_config_tensor_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    cfg["layer_types"] = cfg["layer_types"][:1]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert "unexpected tensor model.layers.1." in _error(ckpt)
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert "model.layers.2." in _error(ckpt)


def test_missing_tensor_never_filled(ckpt):
    name = "model.layers.0.mlp.router.bias"
    _rewrite(_shard_of(ckpt, name), lambda t: t.pop(name))
    msg = _error(ckpt)
    assert name in msg and "missing" in msg


def test_extra_tensor(ckpt):
    shard = _shards(ckpt)[0]
    _rewrite(shard, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(8)}))
    assert "unexpected tensor model.layers.0.self_attn.rotary.inv_freq" in _error(ckpt)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads unreadable files")
def test_unreadable_shard(ckpt):
    victim = _shards(ckpt)[0]
    victim.chmod(0)
    try:
        assert "permission denied" in _error(ckpt)
    finally:
        victim.chmod(0o644)


def test_index_without_weight_map(ckpt):
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in _error(ckpt)


def test_rope_parameters_spelling_accepted(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg.pop("rope_scaling")
    rope["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = rope
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(ckpt).config == MINI

