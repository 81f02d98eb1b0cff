"""row_linear (one-token linear with bias) vs F.linear: odd and block-boundary shapes, both dtypes."""

import pytest
import torch
from helpers import assert_close

from gptoss_cli.kernels.linear import linear_ref, row_linear, supports_row_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,block_n", [(1, 16, 8), (13, 100, 8), (64, 64, 4), (37, 257, 2)])
def test_row_linear_matches_linear(device, dtype, n, k, block_n):
    x = torch.randn(1, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    got = row_linear(x, w, b, block_n=block_n, num_warps=4)
    want = linear_ref(x.float(), w.float(), b.float())
    assert got.dtype == dtype and got.shape == (1, n)
    assert_close(got.float(), want, 1e-5 if dtype == torch.float32 else 8e-3, "row_linear")


def test_row_linear_writes_into_out_and_rejects_bad_shapes(device):
    x, w, b = torch.randn(1, 32, device=device), torch.randn(24, 32, device=device), torch.randn(24, device=device)
    out = torch.full((1, 24), float("nan"), device=device)
    assert row_linear(x, w, b, out=out) is out
    assert_close(out, linear_ref(x, w, b), 1e-5, "out")
    assert supports_row_linear(x, w) and not supports_row_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        row_linear(torch.randn(2, 32, device=device), w, b)
    with pytest.raises(ValueError, match="bias"):
        row_linear(x, w, torch.randn(23, device=device))
