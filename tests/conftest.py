"""Shared test setup: Triton interpreter on CPU-only machines, seeds, tolerances, markers."""

import os

import torch

# Must happen before any module decorates a @triton.jit kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tiny CPU ops with several OpenMP threads on a loaded 2-core machine spin for milliseconds
# each (measured: index_add_ 7.7 ms with 2 threads vs 0.007 ms with 1); tests use one thread.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch, tmp_path_factory):
    """The developer's own ~/.config/gptoss/config.toml must not change what the CLI tests see."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "no-xdg-config"))
    monkeypatch.delenv("GPTOSS_CONFIG", raising=False)
    monkeypatch.delenv("GPTOSS_HOME", raising=False)  # chat state goes where each test says


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
