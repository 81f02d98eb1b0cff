"""decode_slots / advance_decode (the decode graph's bookkeeping launches) against their torch twins."""

import pytest
import torch

from gptoss_cli.kernels.decode_step import (
    TABLE_BLOCK,
    advance_decode,
    advance_decode_ref,
    decode_slots,
    decode_slots_ref,
)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tables(device, rows, max_blocks, num_blocks=5000):
    g = torch.Generator().manual_seed(rows * 7 + max_blocks)
    full = torch.randint(0, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32).to(device)
    slide = torch.randint(0, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32).to(device)
    return full, slide


# max_blocks: odd, one copy step exactly, and more than one copy step (the loop and its mask)
@pytest.mark.parametrize("max_blocks", [37, TABLE_BLOCK, TABLE_BLOCK + 77])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_slots_match_twin(device, max_blocks, batch, block_size):
    full, slide = _tables(device, 9, max_blocks)
    g = torch.Generator().manual_seed(batch)
    rows = torch.randperm(9, generator=g)[:batch].to(device)
    positions = torch.randint(0, max_blocks * block_size, (batch,), generator=g).to(device)
    active = torch.ones(batch, dtype=torch.int64, device=device)
    active[-1] = 0 if batch > 1 else 1  # a padded row: 0 keys
    got = decode_slots(positions, rows, active, full, slide, block_size)
    want = decode_slots_ref(positions, rows, active, full, slide, block_size)
    for name in ("full_tables", "slide_tables", "full_slots", "slide_slots", "seq_lens"):
        g_, w_ = getattr(got, name), getattr(want, name)
        assert g_.dtype == w_.dtype and torch.equal(g_, w_), name


def test_advance_decode_matches_twin(device):
    n = 5
    sampled = torch.tensor([7, 199_999, 0, 3, 42], device=device)
    active = torch.tensor([1, 1, 0, 1, 0], device=device)
    start = [torch.arange(n, device=device) * k for k in (10, 100, 1000)]
    got = [torch.full((n,), -1, device=device)] + [t.clone() for t in start]
    want = [torch.full((n,), -1, device=device)] + [t.clone() for t in start]
    advance_decode(sampled, *got[:1], got[1], got[2], got[3], active)
    advance_decode_ref(sampled, *want[:1], want[1], want[2], want[3], active)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got[2], start[1] + active)  # positions moved only where active


def test_bad_arguments_raise(device):
    full, slide = _tables(device, 4, 8)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="rows"):
        decode_slots(pos, pos.int(), pos, full, slide, 16)
    with pytest.raises(ValueError, match="block tables"):
        decode_slots(pos, pos, pos, full, slide[:, :4], 16)
    with pytest.raises(ValueError, match="active"):
        advance_decode(pos, pos.clone(), pos.clone(), pos.clone(), pos.clone(), pos[:1])


@requires_gpu
def test_decode_step_launches_in_a_cuda_graph():
    full, slide = _tables("cuda", 64, 2048)
    pos = torch.randint(0, 2048 * 64, (64,), device="cuda")
    rows = torch.arange(64, device="cuda")
    active = torch.ones(64, dtype=torch.int64, device="cuda")
    decode_slots(pos, rows, active, full, slide, 64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = decode_slots(pos, rows, active, full, slide, 64)
    pos.random_(0, 2048 * 64)
    graph.replay()
    want = decode_slots_ref(pos, rows, active, full, slide, 64)
    assert torch.equal(got.full_slots, want.full_slots) and torch.equal(got.full_tables, want.full_tables)
