"""From a model spec (checkpoint directory or random:NAME) to weights, tokenizer and engine.

Aliases such as `20b` are resolved to directories by the CLI (hub.py) before reaching here.
The engine is chosen by hardware: the GPU engine when CUDA is present, else the CPU engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .api import Engine
from .checkpoint import ModelWeights, check_directory, load_checkpoint
from .config import load_model_config
from .random_checkpoint import PREFIX, random_config, random_weights


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_weights(spec: str | os.PathLike, device: str | None = None, seed: int = 0) -> ModelWeights:
    """`random:tiny|20b|120b` (generated in memory, seeded) or a checkpoint directory."""
    device = device or default_device()
    text = str(spec)
    if text.startswith(PREFIX):
        name = text[len(PREFIX):]
        _preflight(random_config(name), device)
        return random_weights(name, seed=seed, device=device)
    path = Path(text).expanduser()
    check_directory(path)
    _preflight(load_model_config(path / "config.json"), device)
    return load_checkpoint(path, device=device)


def _preflight(cfg, device: str) -> None:
    if torch.device(device).type == "cuda":
        from .gpu.preflight import check_device, check_weights_fit

        check_device(torch.device(device))
        check_weights_fit(cfg, torch.device(device))


def load_tokenizer(weights: ModelWeights):
    """The checkpoint's tokenizer.json; random models use the real o200k vocabulary."""
    from .tokenizer import Tokenizer, load_o200k_base_ranks

    if weights.tokenizer_path is not None:
        return Tokenizer.from_tokenizer_json(weights.tokenizer_path)
    return Tokenizer.from_ranks(load_o200k_base_ranks())


def create_engine(weights: ModelWeights, progress=None, **options) -> Engine:
    """The GPU engine for weights on a CUDA device, else the CPU reference engine.

    `progress(stage, done, total)` is called during warm-up (graph capture)."""
    if weights.device.type == "cuda":
        from .gpu.engine import GpuEngine

        return GpuEngine(weights, progress=progress, **options)
    from .cpu_engine import CpuEngine

    options.pop("cuda_graphs", None)
    return CpuEngine(weights, **options)
