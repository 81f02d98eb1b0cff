"""Hugging Face gpt-oss checkpoint directories: the tensor schema, validation and loading.

A checkpoint is config.json + generation_config.json + tokenizer.json + safetensors shards
(found through model.safetensors.index.json, or by glob). Every header is read and checked
against the schema the config implies before any tensor data is touched: missing, extra,
mis-shaped or mis-typed tensors and truncated shards fail with one line naming file and
tensor. MXFP4 experts stay packed (uint8); other tensors keep their stored dtype. Shards are
loaded one at a time, straight onto the target device.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import GenerationConfig, ModelConfig, load_generation_config, load_model_config, read_json
from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "U8": torch.uint8,
              "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F64": torch.float64,
              "BOOL": torch.bool, "I16": torch.int16, "F8_E4M3": None, "F8_E5M2": None}
_FLOATS = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    packed: bool  # True: uint8 MXFP4 blocks/scales; False: a bf16 (or fp32) float tensor


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a gpt-oss checkpoint of this config holds (HF names), in file order."""
    c, e, i = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    f = lambda *s: TensorSpec(tuple(s), False)  # noqa: E731
    u8 = lambda *s: TensorSpec(tuple(s), True)  # noqa: E731
    spec = {"model.embed_tokens.weight": f(cfg.vocab_size, c)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        spec.update({
            p + "input_layernorm.weight": f(c),
            p + "self_attn.q_proj.weight": f(cfg.q_size, c),
            p + "self_attn.q_proj.bias": f(cfg.q_size),
            p + "self_attn.k_proj.weight": f(cfg.kv_size, c),
            p + "self_attn.k_proj.bias": f(cfg.kv_size),
            p + "self_attn.v_proj.weight": f(cfg.kv_size, c),
            p + "self_attn.v_proj.bias": f(cfg.kv_size),
            p + "self_attn.o_proj.weight": f(c, cfg.q_size),
            p + "self_attn.o_proj.bias": f(c),
            p + "self_attn.sinks": f(cfg.num_attention_heads),
            p + "post_attention_layernorm.weight": f(c),
            p + "mlp.router.weight": f(e, c),
            p + "mlp.router.bias": f(e),
            p + "mlp.experts.gate_up_proj_blocks": u8(e, 2 * i, c // 32, 16),
            p + "mlp.experts.gate_up_proj_scales": u8(e, 2 * i, c // 32),
            p + "mlp.experts.gate_up_proj_bias": f(e, 2 * i),
            p + "mlp.experts.down_proj_blocks": u8(e, c, i // 32, 16),
            p + "mlp.experts.down_proj_scales": u8(e, c, i // 32),
            p + "mlp.experts.down_proj_bias": f(e, c),
        })
    spec["model.norm.weight"] = f(c)
    spec["lm_head.weight"] = f(cfg.vocab_size, c)
    return spec


@dataclass
class ModelWeights:
    """A loaded (or generated) checkpoint: config plus tensors by HF name."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)
    source: str = ""  # directory path or random:NAME, for messages
    tokenizer_path: Path | None = None  # tokenizer.json; None for in-memory random models

    def layer(self, n: int, name: str) -> torch.Tensor:
        return self.tensors[f"model.layers.{n}.{name}"]

    @property
    def device(self) -> torch.device:
        return self.tensors["lm_head.weight"].device


# ---- safetensors headers -----------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    end: int  # absolute byte offset where the tensor's data ends


def _read_header(path: Path) -> dict[str, _Entry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)", _REDOWNLOAD)
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: corrupted safetensors header", _REDOWNLOAD)
            header = json.loads(fh.read(n))
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied", "make the file readable (chmod +r)")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupted safetensors header", _REDOWNLOAD)
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = meta["data_offsets"]
            entries[name] = _Entry(path, meta["dtype"], tuple(meta["shape"]), 8 + n + stop)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupted safetensors header entry {name!r}", _REDOWNLOAD)
    end = max((e.end for e in entries.values()), default=8 + n)
    if end > size:
        raise CheckpointError(f"{path}: truncated ({size} of {end} bytes present)", _REDOWNLOAD)
    return entries


_REDOWNLOAD = "the file is incomplete or corrupted; download the checkpoint again (gptoss download)"


def find_shards(directory: Path) -> list[Path]:
    """Shard files from the index (all must exist) or, without an index, by glob."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map", _REDOWNLOAD)
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.exists():
                raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing", _REDOWNLOAD)
        return shards
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{directory}: no *.safetensors files", _REDOWNLOAD)
    return shards


def validate(directory: Path, cfg: ModelConfig) -> dict[str, _Entry]:
    """Check every shard header against the schema; return where each tensor lives."""
    found: dict[str, _Entry] = {}
    for shard in find_shards(directory):
        for name, entry in _read_header(shard).items():
            if name in found:
                raise CheckpointError(f"{shard}: tensor {name} also in {found[name].file.name}", _REDOWNLOAD)
            found[name] = entry
    spec = expected_tensors(cfg)
    for name, want in spec.items():
        if name not in found:
            raise CheckpointError(f"{directory}: tensor {name} is missing from every shard", _REDOWNLOAD)
        _check_entry(name, found[name], want)
    extra = sorted(set(found) - set(spec))
    if extra:
        raise CheckpointError(
            f"{found[extra[0]].file}: unexpected tensor {extra[0]} ({len(extra)} extra in all)",
            "config.json does not match the weights; use the config.json that came with them",
        )
    return found


def _check_entry(name: str, got: _Entry, want: TensorSpec) -> None:
    if got.shape != want.shape:
        raise CheckpointError(
            f"{got.file}: tensor {name} has shape {list(got.shape)}, config.json implies {list(want.shape)}",
            "config.json does not match the weights; use the config.json that came with them",
        )
    dtype = _ST_DTYPES.get(got.dtype)
    ok = dtype == torch.uint8 if want.packed else dtype in _FLOATS
    if not ok:
        expect = "U8 (MXFP4)" if want.packed else "BF16"
        raise CheckpointError(f"{got.file}: tensor {name} has dtype {got.dtype}, expected {expect}", _REDOWNLOAD)


# ---- loading -------------------------------------------------------------------------------

def check_directory(path: Path) -> None:
    """Fail early, with what to do, on paths that are not HF gpt-oss checkpoint directories."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory", "pass a checkpoint directory, 20b, 120b or random:tiny")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory", "pass the checkpoint directory, not a file inside it")
    if not (path / "config.json").exists():
        if (path / "original" / "config.json").exists():
            raise CheckpointError(
                f"{path}: only the original/ (OpenAI) layout is present",
                "download the Hugging Face layout: gptoss download 20b (or 120b)",
            )
        raise CheckpointError(f"{path}: no config.json", "this is not a Hugging Face checkpoint directory")
    if not (path / "tokenizer.json").exists():
        raise CheckpointError(f"{path}: no tokenizer.json", "download the checkpoint again (gptoss download)")


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> ModelWeights:
    """Validate, then load shard by shard onto `device` (MXFP4 packed, floats as stored)."""
    from safetensors import safe_open

    directory = Path(path)
    check_directory(directory)
    cfg = load_model_config(directory / "config.json")
    entries = validate(directory, cfg)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry.file, []).append(name)
    dev = str(torch.device(device))
    for shard, names in sorted(by_file.items()):
        try:
            with safe_open(str(shard), framework="pt", device=dev) as fh:
                for name in names:
                    tensors[name] = fh.get_tensor(name)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{shard}: cannot be read ({e})", _REDOWNLOAD)
    return ModelWeights(
        config=cfg,
        tensors=tensors,
        generation_config=load_generation_config(directory / "generation_config.json"),
        source=str(directory),
        tokenizer_path=directory / "tokenizer.json",
    )
