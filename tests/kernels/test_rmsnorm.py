"""rms_norm kernel (fused residual add) vs its twin rms_norm_ref, on odd and block-boundary widths."""

import pytest
import torch
from helpers import assert_close, bf16_ulps

from gptoss_cli.kernels.rmsnorm import rms_norm, rms_norm_ref

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(y, h, y_ref, h_ref, dtype, on_gpu):
    if dtype == torch.float32:
        assert torch.equal(h, h_ref)
        assert_close(y, y_ref, 1e-5, "y")
    elif on_gpu:
        assert torch.equal(h, h_ref)  # x + residual rounded to nearest-even, like torch
        assert bf16_ulps(y, y_ref) <= 1.0
    else:
        # The interpreter truncates fp32 -> bf16 stores where torch rounds to nearest even, so
        # stored values may sit one bf16 step towards zero.
        assert bf16_ulps(h, h_ref) <= 1.0
        assert bf16_ulps(y, y_ref) <= 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 100, 2880])
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(device, dtype, width, tokens, with_residual):
    x = (torch.randn(tokens, width, device=device) * 3).to(dtype)
    weight = (torch.rand(width, device=device) + 0.5).to(dtype)
    residual = torch.randn(tokens, width, device=device).to(dtype) if with_residual else None
    y, h = rms_norm(x, weight, 1e-5, residual)
    y_ref, h_ref = rms_norm_ref(x, weight, 1e-5, residual)
    assert y.dtype == h.dtype == dtype
    _check(y, h, y_ref, h_ref, dtype, device == "cuda")
    if not with_residual:
        assert h is x  # nothing to add: the stream is x itself, no copy


def test_eps_and_weight_are_used(device):
    x = torch.randn(5, 96, device=device) * 1e-3  # mean(x^2) ~ eps: eps changes the result
    weight = torch.randn(96, device=device)
    for eps in (1e-6, 1e-5, 1.0):
        y, _ = rms_norm(x, weight, eps)
        assert_close(y, rms_norm_ref(x, weight, eps)[0], 1e-5, f"eps={eps}")


def test_preallocated_outputs_may_alias_inputs(device):
    tokens, width = 9, 200
    x = torch.randn(tokens, width, device=device)
    residual = torch.randn(tokens, width, device=device)
    weight = torch.randn(width, device=device)
    y_ref, h_ref = rms_norm_ref(x, weight, 1e-5, residual)
    y, h = rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual)
    assert y.data_ptr() == x.data_ptr() and h.data_ptr() == residual.data_ptr()
    assert torch.equal(h, h_ref)
    assert_close(y, y_ref, 1e-5, "in place")


def test_strided_rows_and_residual_out_without_residual(device):
    big = torch.randn(6, 300, device=device)
    x = big[:, 17:117]  # row stride 300, unit column stride
    weight = torch.randn(100, device=device)
    h_out = torch.full((6, 100), float("nan"), device=device)
    y, h = rms_norm(x, weight, 1e-5, residual_out=h_out)
    y_ref, h_ref = rms_norm_ref(x, weight, 1e-5)
    assert h is h_out and torch.equal(h, h_ref)
    assert_close(y, y_ref, 1e-5, "strided")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_row_ids_normalise_rows_gathered_from_a_table(device, dtype, tokens):
    # The embedding lookup fused into the first norm: rows of a [V, C] table, repeats included.
    table = (torch.randn(50, 100, device=device) * 3).to(dtype)
    ids = torch.randint(0, 50, (tokens,), device=device)
    ids[0] = ids[-1] = 49
    weight = (torch.rand(100, device=device) + 0.5).to(dtype)
    y, h = rms_norm(table, weight, 1e-5, row_ids=ids)
    y_ref, h_ref = rms_norm_ref(table[ids], weight, 1e-5)
    assert y.shape == h.shape == (tokens, 100) and torch.equal(h, table[ids])
    _check(y, h, y_ref, h_ref, dtype, device == "cuda")


def test_bad_arguments_raise(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(63, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64, device=device), 1e-5, torch.randn(4, 65, device=device))
    with pytest.raises(ValueError, match=r"\[T, C\]"):
        rms_norm(x[None], torch.ones(64, device=device), 1e-5)
    with pytest.raises(TypeError, match="out"):
        fp16_out = torch.empty(4, 64, dtype=torch.float16, device=device)
        rms_norm(x, torch.ones(64, device=device), 1e-5, out=fp16_out)
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="no residual"):
        rms_norm(x, torch.ones(64, device=device), 1e-5, x, row_ids=ids)
    with pytest.raises(ValueError, match="int64"):
        rms_norm(x, torch.ones(64, device=device), 1e-5, row_ids=ids.int())
    with pytest.raises(ValueError, match=r"\(2, 64\)"):
        rms_norm(x, torch.ones(64, device=device), 1e-5, out=torch.empty_like(x), row_ids=ids)


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_rms_norm_real_shapes_gpu(tokens):
    width = 2880
    x = torch.randn(tokens, width, device="cuda").bfloat16()
    residual = (torch.randn(tokens, width, device="cuda") * 10).bfloat16()
    weight = torch.rand(width, device="cuda").bfloat16()
    y, h = rms_norm(x, weight, 1e-5, residual)
    y_ref, h_ref = rms_norm_ref(x, weight, 1e-5, residual)
    _check(y, h, y_ref, h_ref, torch.bfloat16, True)


@requires_gpu
def test_rms_norm_cuda_graph_and_no_sync():
    x = torch.randn(64, 2880, device="cuda").bfloat16()
    residual = torch.randn(64, 2880, device="cuda").bfloat16()
    weight = torch.rand(2880, device="cuda").bfloat16()
    y, h = torch.empty_like(x), torch.empty_like(x)
    rms_norm(x, weight, 1e-5, residual, out=y, residual_out=h)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rms_norm(x, weight, 1e-5, residual, out=y, residual_out=h)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.randn_like(x, dtype=torch.float32))
    graph.replay()
    y_ref, h_ref = rms_norm_ref(x, weight, 1e-5, residual)
    _check(y, h, y_ref, h_ref, torch.bfloat16, True)
