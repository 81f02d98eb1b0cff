"""RMSNorm with the residual add fused (gpt-oss-model.md §2.2).

y = h * rsqrt(mean(h^2) + eps) * weight, h = x (+ residual), statistics in fp32, gain only.

`rms_norm` is one Triton launch: each program normalises ROWS whole rows (the row lives in
registers, so x and residual are read once and y and h written once), ROWS > 1 only for narrow
rows. The sum h = x + residual is rounded to x.dtype before the statistics, exactly as stored.
With `row_ids` the rows are gathered from a table (the embedding lookup before the first block):
the gather is this launch's load instead of a launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, C] -> (normed [T, C] in x.dtype, h = x + residual [T, C] in x.dtype)."""
    h = x.float() if residual is None else x.float() + residual.float()
    h_out = h.to(x.dtype)
    h = h_out.float()  # the residual stream is stored in x.dtype; normalise what is stored
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), h_out


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, ids_ptr,
    T, C, stride_x, stride_r, stride_y, stride_h, eps,
    HAS_RES: tl.constexpr, STORE_H: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
    ROW_IDS: tl.constexpr = False,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    row_ok = rows < T
    mask = row_ok[:, None] & col_ok[None, :]
    if ROW_IDS:
        src = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)[:, None]
    else:
        src = rows.to(tl.int64)[:, None]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + src * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows * stride_r + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the stored dtype first: the statistics see what the stream keeps.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if STORE_H:
        tl.store(h_ptr + rows * stride_h + cols[None, :], x, mask=mask)
    y = normalize_rows(x, w_ptr, cols, col_ok, C, eps)
    tl.store(y_ptr + rows * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def normalize_rows(x, w_ptr, cols, col_ok, C, eps):
    """fp32 y = h * rsqrt(mean(h^2) + eps) * weight for whole rows x [R, BLOCK_C] (the stored h,
    masked columns 0). Shared with the MoE combine that ends a layer (moe_matmul.py)."""
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 1) / C + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return h * rstd[:, None] * w[None, :]


def _check_2d(name: str, t: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x on {device}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along C")


def _launch_shape(c: int) -> tuple[int, int, int]:
    """(BLOCK_C, ROWS, num_warps): whole rows, 2K-4K elements and about 16 per thread per program."""
    block_c = triton.next_power_of_2(c)
    rows = max(1, min(16, 2048 // block_c))
    num_warps = max(1, min(16, block_c * rows // 512))
    return block_c, rows, num_warps


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    row_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref` in one launch: x [T, C] (+ residual [T, C]) -> (y, h), both x.dtype.

    h is x itself when there is no residual and no `residual_out`. `out` / `residual_out` may be
    preallocated (and may alias x or residual: each row is read whole before it is written).
    row_ids [T] int64: normalise the rows x[row_ids] of a table x [V, C] (no residual); h is then
    those rows, stored to `residual_out`. No host sync, so it can be captured in a CUDA graph.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[1]}] on {x.device}, "
                         f"got {tuple(weight.shape)} on {weight.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    shape = tuple(x.shape)  # of out and residual_out
    if row_ids is not None:
        if residual is not None:
            raise ValueError("row_ids gathers the input rows: no residual")
        if row_ids.dim() != 1 or row_ids.dtype != torch.int64 or row_ids.device != x.device:
            raise ValueError(f"row_ids must be a 1-D int64 tensor on {x.device}")
        row_ids = row_ids.contiguous()
        shape = (row_ids.shape[0], x.shape[1])
    if residual is not None:
        _check_2d("residual", residual, shape, x.device)
    store_h = residual is not None or residual_out is not None or row_ids is not None
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device) if store_h else x
    for name, t in (("out", out), ("residual_out", residual_out)):
        _check_2d(name, t, shape, x.device)
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must be {x.dtype}, got {t.dtype}")
    tokens, c = shape
    if tokens == 0:
        return out, residual_out
    block_c, rows, num_warps = _launch_shape(c)
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(tokens, rows),)](
        x, res, weight, out, residual_out, row_ids if row_ids is not None else x,
        tokens, c, x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0), float(eps),
        HAS_RES=residual is not None, STORE_H=store_h, ROWS=rows, BLOCK_C=block_c, ROW_IDS=row_ids is not None,
        num_warps=num_warps)
    return out, residual_out
