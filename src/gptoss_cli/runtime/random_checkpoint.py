"""Seeded random checkpoints in the exact gpt-oss layout: random:tiny, random:20b, random:120b.

Weights are drawn so that activations stay O(1) through the stack and every mechanism is
exercised (sinks and router logits large enough to matter, MXFP4 experts as random packed
nibbles with per-block E8M0 scales), while the network stays well conditioned: a strong SwiGLU
gain or a small embedding makes a random 24-layer stack amplify rounding ~1000x, so that no two
bf16 implementations agree (docs/optimizations.md). The output is meaningless text at the real
model's speed. `write_checkpoint` saves one as a real checkpoint
directory (config, shards + index, tokenizer.json, generation_config.json).

Confident readout (lm_head, opt-in: `confident=True`). With Gaussian lm_head rows the logits
over 201,088 tokens are a flat cloud whose top-two gap (~0.15 sigma) is below bf16 noise (logits
~6 % apart bf16 vs fp32), so no two bf16 implementations agree on greedy decoding past ~4
tokens. Real models are confident; the opt-in readout is too, through a seeded "successor"
bigram:

    lm_head[v] = (b_v + a * e[pi^-1(v)] / |e[pi^-1(v)]|) / sqrt(1 + a^2),   b_v ~ N(0, 1/C)

pi is a seeded permutation of the vocabulary (the successor of token t is pi(t); own generator
"lm_head.weight:successor"), e the stored embedding rows (std 4, regenerated inside this branch
from the embedding's own generator, so a shard still generates on its own; O(V C), in row
chunks). The final hidden state h has |h| ~ sqrt(C) and, as the residual stream is dominated by
the current token's embedding, cosine c with e[t], c ~ 4 / sqrt(16 + 2 L * 0.4): 0.4 is the
variance one attention or MoE block adds to the stream at the 20b shapes (0.23-0.39 at other
widths, where c is then underestimated and the margin a little larger). Every other logit stays
~ N(0, 1) (a random unit direction . h ~ N(0, 1)); the successor's is a*sqrt(C)*c / sqrt(1 + a^2)
+ N(0, 1 / (1 + a^2)), and `a` is solved so that its mean is E[max of V N(0, 1)] (4.55 for the
full vocabulary) + SUCCESSOR_MARGIN = 4 sigma: a = 0.24 for 20b, 0.28 for 120b, 1.5 for tiny.
Measured (scripts/debug_confident.py, 20 prompts x 64 greedy tokens, on 20b): median
gap to the runner-up 4.2 sd, 1st percentile 1.7, minimum 1.0; bf16 and fp32 references agree on
20/20 prompts (0/20 with the old init). A margin of 3 left the closest of the 1280 decisions
0.01 sd from a tie on 20b and lost 1 prompt of 20 at 704 wide; 2.5 and 2 lost 4 and 5.

What this costs. Greedy decoding now follows the chain t -> pi(t) -> ... (100 % of tokens at
margin 4), and context only decides near-ties, which a bf16-proof margin makes rare: the greedy
comparison can only fail for bugs that move the logits by ~1 sd or more. Injected into the fp32
reference of 20b, a dropped sink, queries rotated one position late, one layer's attention
skipped and a decode step that ignores the KV cache (logits 14-22 % off, 2.5-4x bf16's error)
changed 0 of the 20 greedy outputs; a bug must now be caught by a logits tolerance, whose power
is unchanged (same trunk, readout rows still near-random directions). Softmax probability of the
greedy token is only ~2 % (e^8.5 / (V e^0.5 + e^8.5)), so sampling at temperature 1 stays diverse.
That is also why it is not the default: the test suite's token-equality checks (batched == one
at a time, graph == eager, prefix-cached == uncached, engine == reference in fp32) rely on the
flat readout, where any numerical slip flips a token. It serves the bf16 greedy-agreement check
(`gpu_check.py e20b`), whose bf16 noise would otherwise fail every implementation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE, ModelWeights, TensorSpec, expected_tensors
from .config import GenerationConfig, ModelConfig
from .errors import ModelSpecError

PREFIX = "random:"
# E2M1 values are uniform over 16 codes; their root mean square is sqrt(68.5 / 8).
_FP4_RMS = math.sqrt(68.5 / 8)
_EMBED_STD = 4.0
EMBED_NAME = "model.embed_tokens.weight"
# The successor's logit stands this many logit sigmas above the expected maximum of the rest.
SUCCESSOR_MARGIN = 4.0
_BLOCK_VARIANCE = 0.4  # residual variance one attention or MoE block adds (20b shapes, measured)
_CHUNK_ROWS = 8192  # lm_head rows per step of the successor write (bounds temporaries)


def random_config(name: str) -> ModelConfig:
    """The config behind random:NAME."""
    if name == "tiny":
        return ModelConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                           num_local_experts=8, num_experts_per_tok=4)
    if name == "20b":
        return ModelConfig(num_hidden_layers=24, num_local_experts=32)
    if name == "120b":
        return ModelConfig(num_hidden_layers=36, num_local_experts=128)
    raise ModelSpecError(f"unknown random model random:{name}", "use random:tiny, random:20b or random:120b")


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def _float_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    """Std per role: fan-in scaled matrices, visible biases, sinks and router spread."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.normal_(mean, std, generator=g)

    fan_in = shape[-1] if len(shape) > 1 else 1
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        t = normal(0.1, 1.0)
    elif name.endswith("sinks"):
        t = normal(1.5)
    elif name == EMBED_NAME:
        t = normal(_EMBED_STD)  # a residual stream dominated by the embedding damps layer-to-layer growth
    elif name.endswith("router.weight"):
        t = normal(2.0 / math.sqrt(fan_in))
    elif name.endswith("bias"):
        t = normal(0.2)
    else:  # q/k/v/o projections and the Gaussian lm_head
        t = normal(1.0 / math.sqrt(fan_in))
    return t.to(torch.bfloat16)


def _packed_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
    # Scales: weight rms ~ gain / sqrt(K), with K = 32 * blocks per row. A gate_up gain of 2.5
    # reached the SwiGLU clamp but made the stack chaotic (bf16 vs fp32 logits 20 % apart on a
    # 24-layer model vs 2 % at 0.625); the clamp is exercised by the kernel tests and by a
    # dedicated transformers comparison instead.
    k = shape[-1] * 32
    gain = 0.625 if "gate_up" in name else 1.0
    exponent = round(math.log2(gain / (_FP4_RMS * math.sqrt(k))))
    jitter = torch.randint(-1, 2, shape, device=device, generator=g)
    return (127 + exponent + jitter).to(torch.uint8)


def expected_gaussian_max(n: int) -> float:
    """E[max of n independent N(0, 1)] (extreme-value expansion; within 0.03 for n >= 1000)."""
    r = math.sqrt(2 * math.log(n))
    return r - (math.log(math.log(n)) + math.log(4 * math.pi)) / (2 * r) + 0.5772156649 / r


def successor_gain(vocab_size: int, hidden_size: int, num_layers: int,
                   margin: float | None = None) -> float:
    """`a` in the module docstring: the successor's logit lands `margin` sigmas above the
    expected maximum of the other vocab_size - 1 logits."""
    margin = SUCCESSOR_MARGIN if margin is None else margin
    cos = _EMBED_STD / math.sqrt(_EMBED_STD ** 2 + 2 * num_layers * _BLOCK_VARIANCE)
    s = (expected_gaussian_max(vocab_size) + margin) / (math.sqrt(hidden_size) * cos)
    s = min(s, 0.95)  # too narrow a model for the target: take the largest sane gain
    return s / math.sqrt(1 - s * s)


def successor_permutation(vocab_size: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """perm[t] is the token the readout favours after token t (its own generator, so it can be
    drawn without the lm_head)."""
    dev = torch.device(device)
    return torch.randperm(vocab_size, generator=_generator(seed, "lm_head.weight:successor", dev), device=dev)


def _lm_head(shape: tuple[int, ...], seed: int, num_layers: int, device: torch.device) -> torch.Tensor:
    v, c = shape
    g = _generator(seed, "lm_head.weight", device)
    out = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 1.0 / math.sqrt(c), generator=g)
    perm = successor_permutation(v, seed, device)
    a = successor_gain(v, c, num_layers)
    embed = random_tensor(EMBED_NAME, TensorSpec(shape, False), seed, device)  # as stored (bf16)
    for start in range(0, v, _CHUNK_ROWS):
        e = embed[start:start + _CHUNK_ROWS].float()
        rows = perm[start:start + _CHUNK_ROWS]
        out[rows] += e * (a / e.norm(dim=-1, keepdim=True))
    out.mul_(1.0 / math.sqrt(1.0 + a * a))
    return out.to(torch.bfloat16)


def random_tensor(name: str, spec: TensorSpec, seed: int, device: torch.device,
                  config: ModelConfig | None = None, confident: bool = False) -> torch.Tensor:
    """One tensor of a random checkpoint, a function of (seed, name) only. The confident lm_head
    also reads the layer count from `config` (default: 24 layers, as in 20b)."""
    if name == "lm_head.weight" and confident:
        layers = (config or ModelConfig()).num_hidden_layers
        return _lm_head(spec.shape, seed, layers, device)
    g = _generator(seed, name, device)
    make = _packed_tensor if spec.packed else _float_tensor
    return make(name, spec.shape, g, device)


def build_random_weights(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                         source: str = "random:custom", confident: bool = False) -> ModelWeights:
    """Random weights for any config, by the same code path as random:NAME."""
    dev = torch.device(device)
    tensors = {n: random_tensor(n, s, seed, dev, cfg, confident) for n, s in expected_tensors(cfg).items()}
    return ModelWeights(config=cfg, tensors=tensors, generation_config=GenerationConfig(), source=source)


def random_weights(name: str, seed: int = 0, device: str | torch.device = "cpu",
                   confident: bool = False) -> ModelWeights:
    """Build random:NAME in memory on `device` (120b needs ~65 GB there); `confident`: the
    successor readout of the module docstring."""
    return build_random_weights(random_config(name), seed, device, f"{PREFIX}{name}", confident)


def _tensor_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * (1 if spec.packed else 2)


def _plan_shards(specs: dict[str, TensorSpec], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        nbytes = _tensor_bytes(spec)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(directory: str | os.PathLike, name: str, seed: int = 0, device: str | torch.device = "cpu",
                     max_shard_bytes: int = 4_800_000_000, config: ModelConfig | None = None,
                     tokenizer: bool = True, confident: bool = False) -> Path:
    """Write random:NAME (or `config`) as a real HF checkpoint directory; tensors are generated one
    shard at a time so peak memory stays near one shard. `tokenizer=False` skips tokenizer.json
    (a few seconds to derive the merges); `confident`: the successor readout. Returns the directory."""
    from safetensors.torch import save_file

    cfg = config or random_config(name)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specs = expected_tensors(cfg)
    plan = _plan_shards(specs, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
        fname = f"model-{i:05d}-of-{len(plan) - 1:05d}.safetensors"
        shard = {n: random_tensor(n, specs[n], seed, torch.device(device), cfg, confident).cpu() for n in names}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += _tensor_bytes(specs[n])
        del shard
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (out / "generation_config.json").write_text(json.dumps(GenerationConfig().to_dict(), indent=2))
    if tokenizer:
        from .tokenizer import write_tokenizer_json

        write_tokenizer_json(out / "tokenizer.json")
    return out
