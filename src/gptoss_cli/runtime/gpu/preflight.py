"""Will it fit, and can this GPU run it? Checked before weights are loaded and before the KV
cache is sized, so users get a sentence (with what would fit) instead of an OOM traceback."""

from __future__ import annotations

import math
import os

import torch

from ...kernels.moe_config import pick_config
from ..checkpoint import expected_tensors
from ..config import ModelConfig
from ..errors import HardwareError

GIB = 2**30
# Activations, MoE workspace, logits, graph pools and allocator slack beyond weights and KV.
WORKSPACE_BYTES = 3 * GIB


def weights_bytes(cfg: ModelConfig) -> int:
    """Bytes the checkpoint occupies on the GPU (MXFP4 experts packed, the rest bf16)."""
    return sum(math.prod(spec.shape) * (1 if spec.packed else 2) for spec in expected_tensors(cfg).values())


def check_device(device: torch.device) -> None:
    """The kernels need Triton on an NVIDIA GPU of compute capability 8.0 or newer (or, for
    tests on a CPU-only machine, the Triton interpreter)."""
    if device.type != "cuda":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return
        raise HardwareError(f"the GPU engine needs a CUDA device, got {device}", "use the CPU engine")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        name = torch.cuda.get_device_name(device)
        raise HardwareError(f"{name} (compute capability {major}.{minor}) is not supported",
                            "gptoss needs an NVIDIA GPU with compute capability 8.0+ (A100, H100, H200)")


def _packed_bytes(cfg: ModelConfig, suffix: str) -> int:
    """Bytes of the checkpoint's packed expert tensors whose names end in `suffix` (u8: one per element)."""
    return sum(math.prod(spec.shape) for name, spec in expected_tensors(cfg).items()
               if spec.packed and name.endswith(suffix))


def frag_scales_bytes(cfg: ModelConfig) -> int:
    """The engine's second, fragment-order copy of the expert scales (GpuEngineConfig.moe_frag_scales):
    as many bytes as the checkpoint's scales (their K groups are even at gpt-oss shapes)."""
    return _packed_bytes(cfg, "_scales")


def split_blocks_bytes(cfg: ModelConfig) -> int:
    """What the experts' split-word copy of their blocks adds (GpuEngineConfig.moe_split_copy)."""
    return _packed_bytes(cfg, "_blocks")


# The largest share of the GPU's memory the split-word copy may take when moe_split_copy is left
# to the engine (20b: 8.9 GiB, 6 % of an H200; 120b: 53.4 GiB, 38 %).
SPLIT_COPY_SHARE = 0.25


def _batch_decode_reads_split(cfg: ModelConfig, max_batch: int) -> bool:
    """Whether a decode step of max_batch tokens runs the tiles that read the split copy (not the
    batch-1 gemvs or the grouped kernels, which decode checkpoint-order words: chat's batch 1, 20b
    up to 16)."""
    config = pick_config(max_batch, cfg.num_local_experts, cfg.num_experts_per_tok)
    return not config.gemv and not config.group_mma and config.operands == "even_odd"


def want_split_copy(cfg: ModelConfig, device: torch.device, option: bool | None, max_batch: int,
                    dtype: torch.dtype = torch.bfloat16) -> bool:
    """GpuEngineConfig.moe_split_copy resolved once the checkpoint is on the device: None is on
    where the largest decode step reads it (bf16 only: the copy is the asm's) and it takes at most
    SPLIT_COPY_SHARE of the GPU and half of the memory still free (the rest stays for the KV
    cache); True where it does not fit at all is an error, not an OOM."""
    if device.type != "cuda":
        return bool(option)  # the interpreter never reads the copy (its kernels decode bytes)
    need = split_blocks_bytes(cfg)
    free, total = torch.cuda.mem_get_info(device)
    if option is None:
        reads = dtype == torch.bfloat16 and _batch_decode_reads_split(cfg, max_batch)
        return reads and need <= SPLIT_COPY_SHARE * total and need <= free // 2
    if option and need + WORKSPACE_BYTES > free:
        raise HardwareError(f"the experts' split-word copy needs {need / GIB:.1f} GiB; {free / GIB:.1f} GiB are free",
                            "leave moe_split_copy unset (or False) to run without it")
    return option


def check_weights_fit(cfg: ModelConfig, device: torch.device) -> None:
    """Before loading: weights (with the scales' fragment-order copy, on by default) plus a minimal
    KV cache must fit in free memory."""
    free, total = torch.cuda.mem_get_info(device)
    need = weights_bytes(cfg) + frag_scales_bytes(cfg) + WORKSPACE_BYTES
    if need > free:
        raise HardwareError(
            f"the model needs {need / GIB:.1f} GiB of GPU memory; {free / GIB:.1f} of {total / GIB:.1f} GiB are free",
            "free GPU memory (other processes?) or use a smaller model (20b)")


def kv_budget_bytes(device: torch.device, opts, cfg: ModelConfig) -> int:
    """Bytes for the KV pools once the weights are resident (opts.kv_memory_bytes overrides)."""
    if opts.kv_memory_bytes is not None:
        return opts.kv_memory_bytes
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * opts.memory_fraction) - WORKSPACE_BYTES
    if budget <= 0:
        raise HardwareError(f"only {free / GIB:.1f} GiB free after loading the weights",
                            "free GPU memory or use a smaller model")
    return budget
