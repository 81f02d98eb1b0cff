"""The reference model against an independent implementation: transformers' GptOssForCausalLM
loading the same checkpoint directory (it dequantises MXFP4 itself). fp32 on CPU.

Prompts are longer than 300 tokens so both sliding (128-key) and full layers matter; the
random weights make sinks and routing visibly matter, which the mutation checks prove.
"""

import pytest
import torch

from gptoss_cli.runtime.api import SamplingParams
from gptoss_cli.runtime.checkpoint import load_checkpoint
from gptoss_cli.runtime.cpu_engine import CpuEngine
from gptoss_cli.runtime.model_ref import ReferenceModel
from gptoss_cli.runtime.random_checkpoint import write_checkpoint
from helpers import max_rel_err

transformers = pytest.importorskip("transformers")


def _hf_from(path):
    """transformers' model of a checkpoint directory, its experts dequantised in fp32 by transformers
    itself. The dequantisation is asked for explicitly: from 5.25, with the `kernels` package installed
    (a dependency since then), transformers would otherwise fetch MXFP4 kernels from the Hub."""
    return transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


PROMPT_LENS = (301, 417)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=7, max_shard_bytes=60_000_000, tokenizer=False)
    (d / "tokenizer.json").write_text("{}")  # the loader checks it exists; the models don't read it
    return d


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return _hf_from(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    return ReferenceModel(load_checkpoint(ckpt))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 199998, (n,), generator=g).tolist()


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_logits_match_transformers(ours, hf_model, n):
    ids = _prompt(n, seed=n)
    got = ours.forward([(ids, ours.new_cache())], all_logits=True)
    want = _hf_logits(hf_model, ids)
    assert got.shape == want.shape == (n, 201088)
    assert max_rel_err(got, want) <= 1e-4


def test_chunked_prefill_and_batching_match_one_pass(ours):
    a, b = _prompt(300, 1), _prompt(190, 2)
    whole = ours.forward([(a, ours.new_cache())], all_logits=True)
    ca, cb = ours.new_cache(), ours.new_cache()
    first = ours.forward([(a[:200], ca), (b, cb)], all_logits=True)
    rest = ours.forward([(a[200:], ca)], all_logits=True)
    assert max_rel_err(torch.cat([first[:200], rest]), whole) <= 1e-5


@pytest.mark.parametrize("mutation", ["window_129", "no_sinks", "top_3"])
def test_comparison_detects_semantic_errors(ckpt, hf_model, mutation):
    """The tolerance is meaningful: off-by-one windows, dropped sinks or wrong routing fail it."""
    model = ReferenceModel(load_checkpoint(ckpt))
    for layer in model.layers:
        if mutation == "window_129" and layer.window:
            layer.window = 129
        if mutation == "no_sinks":
            layer.sinks = torch.full_like(layer.sinks, -1e9)
    if mutation == "top_3":
        model.config = type(model.config)(**{**model.config.__dict__, "num_experts_per_tok": 3})
    ids = _prompt(301, seed=11)
    got = model.forward([(ids, model.new_cache())], all_logits=True)
    assert max_rel_err(got, _hf_logits(hf_model, ids)) > 1e-3


def test_swiglu_clamp_region_matches_transformers(tmp_path):
    """Expert gate_up scales raised 16x so many SwiGLU inputs pass the clamp at 7."""
    from safetensors.torch import load_file, save_file

    d = write_checkpoint(tmp_path / "hot", "tiny", seed=8, max_shard_bytes=60_000_000, tokenizer=False)
    (d / "tokenizer.json").write_text("{}")
    for shard in d.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith("gate_up_proj_scales")]:
            tensors[name] = tensors[name] + 4
        save_file(tensors, shard, metadata={"format": "pt"})
    model = ReferenceModel(load_checkpoint(d))
    ids = _prompt(160, seed=3)
    hf = _hf_from(d)
    assert max_rel_err(model.forward([(ids, model.new_cache())], all_logits=True), _hf_logits(hf, ids)) <= 1e-4


def test_greedy_continuation_matches_transformers(ckpt, hf_model):
    ids = _prompt(333, seed=5)
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=199999)[0, len(ids):].tolist()
    engine = CpuEngine(load_checkpoint(ckpt))
    (out,) = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert out.token_ids == hf_out
    assert out.finish_reason == "length"
