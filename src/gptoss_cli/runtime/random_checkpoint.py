"""Seeded random checkpoints in the exact gpt-oss layout: random:tiny, random:20b, random:120b.

Weights are drawn so that activations stay O(1) through the stack and every mechanism is
exercised (sinks and router logits large enough to matter, MXFP4 experts as random packed
nibbles with per-block E8M0 scales), while the network stays well conditioned: a strong SwiGLU
gain or a small embedding makes a random 24-layer stack amplify rounding ~1000x, so that no two
bf16 implementations agree (docs/optimizations.md). The output is meaningless text at the real
model's speed. `write_checkpoint` saves one as a real checkpoint
directory (config, shards + index, tokenizer.json, generation_config.json).
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
    elif name == "model.embed_tokens.weight":
        t = normal(4.0)  # a residual stream dominated by the embedding damps layer-to-layer growth
    elif name.endswith("router.weight"):
        t = normal(2.0 / math.sqrt(fan_in))
    elif name.endswith("bias"):
        t = normal(0.2)
    else:  # q/k/v/o projections and lm_head
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


def random_tensor(name: str, spec: TensorSpec, seed: int, device: torch.device) -> torch.Tensor:
    g = _generator(seed, name, device)
    make = _packed_tensor if spec.packed else _float_tensor
    return make(name, spec.shape, g, device)


def random_weights(name: str, seed: int = 0, device: str | torch.device = "cpu") -> ModelWeights:
    """Build random:NAME in memory on `device` (120b needs ~65 GB there)."""
    cfg = random_config(name)
    dev = torch.device(device)
    tensors = {n: random_tensor(n, s, seed, dev) for n, s in expected_tensors(cfg).items()}
    return ModelWeights(config=cfg, tensors=tensors, generation_config=GenerationConfig(),
                        source=f"{PREFIX}{name}")


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
                     tokenizer: bool = True) -> Path:
    """Write random:NAME (or `config`) as a real HF checkpoint directory; tensors are generated one
    shard at a time so peak memory stays near one shard. `tokenizer=False` skips tokenizer.json
    (a few seconds to derive the merges). Returns the directory."""
    from safetensors.torch import save_file

    cfg = config or random_config(name)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specs = expected_tensors(cfg)
    plan = _plan_shards(specs, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
        fname = f"model-{i:05d}-of-{len(plan) - 1:05d}.safetensors"
        shard = {n: random_tensor(n, specs[n], seed, torch.device(device)).cpu() for n in names}
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
