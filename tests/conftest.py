"""Shared test setup: Triton interpreter on CPU-only machines, seeds, tolerances, markers."""

import os

import torch

# Must happen before any module decorates a @triton.jit kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
