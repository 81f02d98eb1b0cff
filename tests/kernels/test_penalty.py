"""Repetition penalty: the host's seen-set words, apply_penalty and mark_seen against their twins."""

import numpy as np
import pytest
import torch

from gptoss_cli.kernels import penalty as pen
from gptoss_cli.kernels.decode_step import SeenSets, advance_decode, advance_decode_ref
from gptoss_cli.kernels.penalty import (
    apply_penalty,
    apply_penalty_mask_ref,
    apply_penalty_ref,
    mark_seen,
    mark_seen_ref,
    seen_mask_ref,
    seen_width,
    seen_words,
)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _seen(device, rows, vocab, per_row=40, seed=0):
    """A seen-set buffer whose rows hold random ids, always including 0, 31, 32 and vocab - 1
    (word edges and the sign bit), and the id lists it was built from."""
    g = torch.Generator().manual_seed(seed)
    lists = []
    bits = np.zeros((rows, seen_width(vocab)), np.int32)
    for r in range(rows):
        ids = torch.randint(0, vocab, (per_row,), generator=g).tolist() + [0, 31, 32, vocab - 1]
        lists.append(ids)
        bits[r] = seen_words(ids, vocab)
    return torch.from_numpy(bits).to(device), lists


def test_seen_words_hold_exactly_the_ids():
    vocab = 100
    words = seen_words([0, 31, 32, 63, 99, 31], vocab)
    assert words.dtype == np.int32 and words.shape == (4,)
    got = {i for i in range(vocab) if (int(words[i >> 5]) >> (i & 31)) & 1}
    assert got == {0, 31, 32, 63, 99}
    assert words[0] < 0  # bit 31 is the sign bit of the int32 word
    assert not seen_words([], vocab).any()
    with pytest.raises(ValueError, match="token ids"):
        seen_words([vocab], vocab)
    with pytest.raises(ValueError, match="token ids"):
        seen_words([-1], vocab)


def test_seen_mask_ref_reads_the_words():
    bits, lists = _seen("cpu", 3, 77)
    mask = seen_mask_ref(bits, torch.tensor([2, 0]), 77)
    for b, r in enumerate((2, 0)):
        assert set(torch.nonzero(mask[b]).flatten().tolist()) == set(lists[r])


def test_penalty_ref_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 0.0, 4.0], [2.0, -2.0, 0.0, 4.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    out = apply_penalty_mask_ref(logits, mask, torch.tensor([2.0, 1.0]))
    assert out.tolist() == [[1.0, -4.0, 0.0, 4.0], [2.0, -2.0, 0.0, 4.0]]  # penalty 1 is off


# vocab: one program exactly, a ragged last block, several blocks; dtypes: the engine's bf16 logits
# and the CPU reference's fp32
@pytest.mark.parametrize("vocab", [pen.BLOCK, 1000, 2 * pen.BLOCK + 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_penalty_matches_twin(device, vocab, dtype):
    bits, lists = _seen(device, 5, vocab)
    rows = torch.tensor([3, 1, 4, 0], device=device)
    penalty = torch.tensor([1.3, 1.0, 0.7, 2.0], device=device)
    logits = (torch.randn(4, vocab) * 5).to(dtype).to(device)
    got, want = logits.clone(), logits.clone()
    apply_penalty(got, bits, rows, penalty)
    apply_penalty_ref(want, bits, rows, penalty)
    if dtype == torch.float32 or got.is_cuda:
        assert torch.equal(got, want)  # one fp32 operation and one rounding: exact
    else:  # the interpreter's fp32 -> bf16 conversion truncates: one bf16 step apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    changed = got != logits
    assert not changed[1].any()  # the row with penalty 1 is untouched
    seen0 = torch.zeros(vocab, dtype=torch.bool)
    seen0[lists[3]] = True
    assert not changed[0].cpu()[~seen0].any()  # only seen ids move
    assert changed[0].cpu()[seen0 & (logits[0].cpu() != 0)].all()


def test_apply_penalty_on_a_row_view_with_a_stride(device):
    """The engine's logits may be rows of a wider buffer: the row stride is honoured."""
    vocab = 300
    bits, _ = _seen(device, 2, vocab)
    wide = torch.randn(2, vocab + 20, device=device)
    got = wide[:, :vocab]
    want = got.clone()
    rows, penalty = torch.tensor([1, 0], device=device), torch.tensor([1.5, 1.5], device=device)
    apply_penalty(got, bits, rows, penalty)
    apply_penalty_ref(want, bits, rows, penalty)
    assert torch.equal(got, want)
    assert torch.equal(wide[:, vocab:], wide[:, vocab:].clone())


def test_mark_seen_matches_twin(device):
    vocab = 1000
    bits, _ = _seen(device, 6, vocab)
    rows = torch.tensor([5, 2, 0, 3], device=device)
    ids = torch.tensor([999, 31, 7, 64], device=device)
    penalty = torch.tensor([1.2, 0.9, 1.0, 1.1], device=device)  # row 0 (padding) has penalty 1
    got, want = bits.clone(), bits.clone()
    mark_seen(got, rows, ids, penalty)
    mark_seen_ref(want, rows, ids, penalty)
    assert torch.equal(got, want)
    mask = seen_mask_ref(got, rows, vocab)
    assert mask[0, 999] and mask[1, 31] and mask[3, 64]
    assert torch.equal(got[0], bits[0])  # penalty 1 writes nothing


def test_advance_decode_marks_the_sampled_ids(device):
    vocab, n = 500, 4
    bits = torch.zeros(5, seen_width(vocab), dtype=torch.int32, device=device)
    sampled = torch.tensor([31, 63, 499, 7], device=device)
    active = torch.tensor([1, 1, 1, 0], device=device)
    seen_rows = torch.tensor([4, 1, 2, 0], device=device)
    penalty = torch.tensor([1.5, 1.0, 0.8, 1.0], device=device)
    outs = []
    for fn in (advance_decode, advance_decode_ref):
        state = [torch.zeros(n, dtype=torch.int64, device=device) for _ in range(4)]
        b = bits.clone()
        fn(sampled, *state, active, SeenSets(b, seen_rows, penalty))
        outs.append((state, b))
    (got_state, got_bits), (want_state, want_bits) = outs
    assert all(torch.equal(a, b) for a, b in zip(got_state, want_state))
    assert torch.equal(got_bits, want_bits)
    mask = seen_mask_ref(got_bits, torch.arange(5, device=device), vocab)
    marked = {(r, i) for r, i in torch.nonzero(mask).tolist()}
    assert marked == {(4, 31), (2, 499)}  # penalty 1 rows (and the padding row) mark nothing


def test_bad_arguments_raise(device):
    bits, _ = _seen(device, 2, 100)
    logits = torch.zeros(1, 100, device=device)
    rows, penalty = torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device)
    with pytest.raises(ValueError, match="seen must be"):
        apply_penalty(logits, bits[:, :2], rows, penalty)
    with pytest.raises(ValueError, match="rows must be"):
        apply_penalty(logits, bits, rows.int(), penalty)
    with pytest.raises(ValueError, match="penalty must be"):
        apply_penalty(logits, bits, rows, penalty.double())
    with pytest.raises(ValueError, match="ids must be"):
        mark_seen(bits, rows, rows.int(), penalty)


@requires_gpu
def test_penalty_launches_in_a_cuda_graph():
    vocab = 201_088
    bits, _ = _seen("cuda", 9, vocab, per_row=4000)
    rows = torch.arange(1, 9, device="cuda")
    penalty = torch.linspace(0.5, 2.0, 8, device="cuda")
    penalty[2] = 1.0
    logits = torch.randn(8, vocab, device="cuda").bfloat16()
    ids = torch.randint(0, vocab, (8,), device="cuda")
    want_logits, want_bits = logits.clone(), bits.clone()
    apply_penalty_ref(want_logits, want_bits, rows, penalty)
    mark_seen_ref(want_bits, rows, ids, penalty)
    work_logits, work_bits = logits.clone(), bits.clone()
    apply_penalty(work_logits, work_bits, rows, penalty)  # compile outside the capture
    mark_seen(work_bits, rows, ids, penalty)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_penalty(work_logits, work_bits, rows, penalty)
        mark_seen(work_bits, rows, ids, penalty)
    work_logits.copy_(logits)
    work_bits.copy_(bits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work_logits, want_logits)
    assert torch.equal(work_bits, want_bits)
