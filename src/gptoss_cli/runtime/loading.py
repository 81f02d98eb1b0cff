"""From a model spec (checkpoint directory or random:NAME) to weights, tokenizer and engine.

Aliases such as `20b` are resolved to directories by the CLI (hub.py) before reaching here.
The engine is chosen by hardware: the GPU engine when CUDA is present, else the CPU engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .api import Engine
from .checkpoint import ModelWeights, load_checkpoint
from .random_checkpoint import PREFIX, random_weights


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_weights(spec: str | os.PathLike, device: str | None = None, seed: int = 0) -> ModelWeights:
    """`random:tiny|20b|120b` (generated in memory, seeded) or a checkpoint directory."""
    device = device or default_device()
    text = str(spec)
    if text.startswith(PREFIX):
        return random_weights(text[len(PREFIX):], seed=seed, device=device)
    return load_checkpoint(Path(text).expanduser(), device=device)


def load_tokenizer(weights: ModelWeights):
    """The checkpoint's tokenizer.json; random models use the real o200k vocabulary."""
    from .tokenizer import Tokenizer, load_o200k_base_ranks

    if weights.tokenizer_path is not None:
        return Tokenizer.from_tokenizer_json(weights.tokenizer_path)
    return Tokenizer.from_ranks(load_o200k_base_ranks())


def create_engine(weights: ModelWeights, **options) -> Engine:
    """The fastest engine the hardware allows for these weights."""
    from .cpu_engine import CpuEngine

    return CpuEngine(weights, **options)
