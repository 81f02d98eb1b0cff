"""Whether the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), and the dot
operand dtype that follows from it: the interpreter computes bf16/fp16 dots wrongly, so there
every kernel loads 16-bit data and computes in fp32 (../shared/reference/testing-on-cpu.md)."""

from __future__ import annotations

import os

import torch
import triton.language as tl


def is_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of tl.dot for inputs of `dtype`: fp32 in the interpreter and for fp32 inputs,
    else the input's own 16-bit type."""
    if is_interpreted() or dtype == torch.float32:
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
