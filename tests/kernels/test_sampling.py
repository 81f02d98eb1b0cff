"""sample kernel vs sample_ref: bit-exact uniforms, same tokens, exact kept sets, statistics, graphs."""

import pytest
import torch
import triton
import triton.language as tl

from gptoss_cli.kernels import sampling, sampling_threshold
from gptoss_cli.kernels.sampling import (SamplingRows, filter_ref, row_key, sample, sample_ref, sample_uniforms,
                                         uniform_ref)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Rows(SamplingRows):
    """Per-row sampling parameters, as the engine passes them, with test constructors."""

    @classmethod
    def make(cls, n, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        def col(v, dtype):
            return torch.as_tensor(v, dtype=dtype).expand(n).to(device).contiguous()

        return cls(col(temperature, torch.float32), col(top_k, torch.int32), col(top_p, torch.float32),
                   col(min_p, torch.float32), torch.randint(-2**62, 2**62, (n,), device=device),
                   torch.randint(0, 2**40, (n,), device=device))

    def filters(self):
        return self.temperature, self.top_k, self.top_p, self.min_p


def _on_the_edge(p, rows, tol=2e-5):
    """[B, V]: tokens whose fate the twin decides within fp32 rounding: their mass above is
    within tol of top_p, or p / max(p) within tol of min_p. Sums taken in another order (or
    with the GPU's exp2) may keep or drop exactly these."""
    mass_above = sampling._mass_above(p)
    ratio = p / p.max(dim=-1, keepdim=True).values
    top_p, min_p = rows.top_p[:, None], rows.min_p[:, None]
    near_top_p = ((mass_above - top_p).abs() <= tol) & (top_p < 1)
    near_min_p = ((ratio - min_p).abs() <= tol) & (min_p > 0)
    return (near_top_p | near_min_p) & (p > 0)  # tokens top-k dropped are never on an edge


def _assert_same_tokens(got, logits, rows, tie_tol=1e-5):
    """got == sample_ref, except rows where the kernel's token is kept (or on the edge of the
    kept set) and its twin score ties the twin's token within tie_tol (relative): fp32
    rounding may order near-ties differently."""
    want = sample_ref(logits, *rows.args())
    assert got.dtype == torch.int64 and got.shape == want.shape
    bad = (got != want).nonzero().flatten().tolist()
    if not bad:
        return
    p, drop = filter_ref(logits, *rows.filters())
    edge = _on_the_edge(p, rows)
    u = uniform_ref(row_key(rows.seeds, rows.offsets), logits.shape[1])
    score = torch.log(p.clamp_min(1e-38)) - torch.log(-torch.log(u))
    for b in bad:
        g, w = int(got[b]), int(want[b])
        s = logits[b].float() if rows.temperature[b] <= 0 else score[b]
        near = abs(s[g] - s[w]) <= tie_tol * max(1.0, abs(float(s[w])))
        kept = not drop[b, g] or edge[b, g]
        assert near and kept, f"row {b}: got {g} (score {s[g]}), want {w} (score {s[w]})"


def _logits(n, vocab, device, dtype=torch.float32, scale=3.0):
    return (torch.randn(n, vocab, device=device) * scale).to(dtype)


def _peaked_logits(n, vocab, device, dtype=torch.float32, strong=300):
    """A language model's shape: `strong` tokens 20 to 30 above a N(0, 2^2) tail. Filtered rows
    then keep a window of at most `strong` tokens, so `sample` takes its windowed path."""
    logits = torch.randn(n, vocab, device=device) * 2
    ids = torch.stack([torch.randperm(vocab, device=device)[:strong] for _ in range(n)])
    logits.scatter_(1, ids, torch.rand(n, strong, device=device) * 10 + 20)
    return logits.to(dtype)


FULL_PASSES = sampling.SampleLaunch(block_chunk=1024, block_window=1024, block_finish=1024, cap=64,
                                    max_splits=4, window=0)  # no window: every filtered row re-reads


def _window_fits(logits, rows, num_splits):
    """Whether every filtered row's window fits the segments `sample` sizes on this device (a
    host estimate of `_window_floor`), i.e. whether the windowed path is the one under test."""
    n, vocab = logits.shape
    l = logits.float()
    m = l.max(dim=1).values
    t, p, mp = rows.temperature, rows.top_p, rows.min_p
    floor = m - 20.5 * t
    top_p_floor = m + t * (torch.log((1 - p) / vocab) - 1)
    floor = torch.where((p < 1) & (p > 0), torch.maximum(floor, top_p_floor), floor)
    floor = torch.where(mp > 0, torch.maximum(floor, m + t * torch.log(mp.clamp_min(1e-30))), floor)
    launch = sampling.GPU_LAUNCH if logits.is_cuda else sampling.CPU_LAUNCH
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), launch.block_chunk) * launch.block_chunk
    inside = torch.stack([c.sum(dim=1) for c in (l >= floor[:, None]).split(chunk, dim=1)], dim=1)
    seg = launch.window // inside.shape[1] // 16 * 16  # as `sample` sizes the segments
    return bool((inside <= seg).all())


def test_uniforms_bit_exact(device):
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789012345], device=device)
    offsets = torch.tensor([0, 1, 2**32 + 5, 7, 2**40, 3], device=device)
    got = sample_uniforms(seeds, offsets, 4999)
    want = uniform_ref(row_key(seeds, offsets), 4999)
    assert torch.equal(got, want)
    assert 0.0 < got.min() and got.max() < 1.0


def test_cpu_uniforms_equal_the_int64_hash():
    # uniform_ref takes numpy's wrapping uint32 arithmetic on the CPU; the int64 formulation
    # (the GPU's torch path) defines the bits. Keys at both ends of the uint32 range wrap.
    keys = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**31]), torch.randint(0, 2**32, (12,))])
    assert torch.equal(sampling._uniform_np(keys, 70001), sampling._uniform_torch(keys, 70001))
    assert torch.equal(uniform_ref(keys, 3), sampling._uniform_torch(keys, 3))


def test_mass_above_equals_the_binary_search_form():
    # Runs of equal probabilities (the rounding below makes many) must all get the mass of the
    # entries strictly larger: total minus the cumulative sum up to the run's last entry.
    p = torch.softmax(torch.randn(4, 5000) * 3, dim=-1)
    p = (p * 1e4).round() / 1e4
    p[2] = 1 / 5000  # one run over the whole row
    asc = torch.sort(p, dim=-1).values
    cum = torch.cumsum(asc, dim=-1)
    want = cum[:, -1:] - cum.gather(1, torch.searchsorted(asc, p, right=True) - 1)
    got = sampling._mass_above(p)
    assert torch.equal(got, want)
    assert (got[2] == 0).all() and (p.unique(dim=-1).shape[1] < 5000)


def test_top_p_one_keeps_every_token_with_top_k():
    # top_p = 1 filters nothing, also where the fp32 mass above a token rounds up to 1.
    logits = torch.randn(2, 50000) * 4
    _, drop = filter_ref(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 40000]), torch.tensor([1.0, 1.0]),
                         torch.tensor([0.0, 0.0]))
    assert not drop[0].any()
    assert int((~drop[1]).sum()) == 40000


def test_greedy_is_first_argmax(device):
    logits = _logits(5, 4999, device)
    logits[1, [17, 3000, 4998]] = 50.0  # tie: lowest index wins
    logits[2, 4998] = 60.0  # the last element of the last, partial block
    logits[3] = float("-inf")  # nothing finite: token 0, like torch.argmax
    logits[4, 1024] = 70.0  # the first element of a block
    rows = Rows.make(5, device, temperature=0.0, top_k=3, top_p=0.5)  # filters ignored when greedy
    got = sample(logits, *rows.args(), num_splits=3)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1] == 17 and got[3] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_temperature_rows_match_ref(device, dtype, num_splits):
    n = 12
    logits = _logits(n, 4999, device, dtype)
    rows = Rows.make(n, device, temperature=torch.rand(n) * 1.5 + 0.2)
    _assert_same_tokens(sample(logits, *rows.args(), num_splits=num_splits), logits, rows)


def _filtered_logits(path, n, vocab, device, dtype):
    """(logits, launch) that send filtered rows down `path`: "window" or "full" passes."""
    if path == "window":
        return _peaked_logits(n, vocab, device, dtype), None
    return _logits(n, vocab, device, dtype), FULL_PASSES


@pytest.mark.parametrize("path", ["window", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_match_ref(device, dtype, path):
    vocab = 3001
    top_k = torch.tensor([1, 2, 7, 50, 299, vocab - 1, vocab, vocab + 5, -1, 64])
    logits, launch = _filtered_logits(path, len(top_k), vocab, device, dtype)
    logits[9, ::30] = logits[9].max() - 1  # 101 tied values around the 64th place
    rows = Rows.make(len(top_k), device, temperature=0.8, top_k=top_k)
    if path == "window":
        assert _window_fits(logits, rows, 3)
    _assert_same_tokens(sample(logits, *rows.args(), num_splits=3, launch=launch), logits, rows)


@pytest.mark.parametrize("path", ["window", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_and_min_p_rows_match_ref(device, dtype, path):
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0, 1.0, 0.7, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.5, 0.1, 0.01])
    logits, launch = _filtered_logits(path, len(top_p), 2999, device, dtype)
    rows = Rows.make(len(top_p), device, temperature=torch.rand(len(top_p)) + 0.3, top_p=top_p, min_p=min_p)
    if path == "window":
        assert _window_fits(logits, rows, 1)
    _assert_same_tokens(sample(logits, *rows.args(), num_splits=1, launch=launch), logits, rows)


@pytest.mark.parametrize("path", ["window", "full"])
def test_mixed_rows_in_one_batch(device, path):
    """Greedy, plain, top-k, top-p, min-p and combined rows together; each row's token must not
    depend on its neighbours or on its position in the batch."""
    rows = Rows.make(8, device, temperature=[0.0, 1.0, 0.7, 1.2, 0.9, 1.0, 0.0, 0.6],
                     top_k=[0, 0, 40, 0, 0, 100, 5, 20], top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 0.5, 0.95],
                     min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.02, 0.0, 0.05])
    logits, launch = _filtered_logits(path, 8, 4000, device, torch.bfloat16)
    if path == "window":
        assert _window_fits(logits, rows, 2)
    got = sample(logits, *rows.args(), num_splits=2, launch=launch)
    _assert_same_tokens(got, logits, rows)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4], device=device)
    permuted = Rows(*(t[perm] for t in rows.args()))
    assert torch.equal(sample(logits[perm], *permuted.args(), num_splits=2, launch=launch), got[perm])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_keeps_every_candidate(device, num_splits):
    """A handful of likely tokens at block, chunk and row edges, many seeds: a window that loses
    or misplaces any one of them changes some tokens."""
    vocab, n = 3001, 24
    edges = torch.tensor([0, 1, 1023, 1024, 2047, 2048, 2999, 3000], device=device)
    logits = torch.randn(n, vocab, device=device) - 20.0  # far below the window
    logits[:, edges] = 12.0 + torch.rand(n, len(edges), device=device)
    i = torch.arange(n)
    rows = Rows.make(n, device, temperature=1.0, top_p=torch.where(i % 2 == 0, 0.95, 1.0),
                     top_k=torch.where(i % 3 == 0, 6, 0), min_p=torch.where(i % 4 == 1, 0.3, 0.0))
    assert _window_fits(logits, rows, num_splits)
    got = sample(logits, *rows.args(), num_splits=num_splits)
    _assert_same_tokens(got, logits, rows)
    assert len(set(got.tolist())) >= 5  # the draws really spread over the edge tokens


def test_top_k_beyond_the_window_with_top_p(device):
    """top-k larger than the window together with top-p needs the exact top-k mass: such rows
    must take the full passes and still match."""
    logits = _peaked_logits(4, 2999, device, strong=50)
    rows = Rows.make(4, device, temperature=0.9, top_k=[1000, 1000, 40, 2000], top_p=[0.95, 0.5, 0.9, 1.0])
    _assert_same_tokens(sample(logits, *rows.args(), num_splits=1), logits, rows)


@triton.jit
def _threshold_kernel(logits_ptr, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, scratch_ptr, out_ptr,
                      BLOCK: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr):
    b = tl.program_id(0)
    row = logits_ptr + b * V
    top, _ = sampling._argmax_pass(row, 0, V, float("-inf"), 1.0, 0, row, False, False, False, BLOCK)
    thr = sampling_threshold.filtered_threshold(row, V, V, top, tl.load(temp_ptr + b), tl.load(topk_ptr + b),
                                                tl.load(topp_ptr + b), tl.load(minp_ptr + b), -1.0,
                                                scratch_ptr + b * CAP, BLOCK, NT, CAP, 16)
    tl.store(out_ptr + b, thr)


def _kept_by_kernel(logits, rows, block=512, thresholds=4, cap=16):
    n, vocab = logits.shape
    thr = torch.empty(n, device=logits.device)
    scratch = torch.empty(n, cap, device=logits.device)
    _threshold_kernel[(n,)](logits, vocab, *rows.filters(), scratch, thr, BLOCK=block, NT=thresholds, CAP=cap)
    return logits.float() >= thr[:, None]


@pytest.mark.parametrize("case", ["continuous", "ties"])
def test_kept_sets_are_exact(device, case):
    """The kernel's threshold keeps exactly the twin's kept set. Small search tiles (4 thresholds,
    16 gathered) force several narrowing passes, gathers and the one-distinct-value exit."""
    n, vocab = 14, 1500
    logits = _logits(n, vocab, device)
    if case == "ties":
        logits = logits.round()  # about a dozen distinct values with hundreds of copies each
    # Rows 12 and 13: top-p keeps all of the top-k set, so top-k decides the threshold.
    rows = Rows.make(n, device, temperature=torch.rand(n) + 0.3,
                     top_k=[0, 1, 3, 40, 700, 0, 0, 0, 25, 400, 0, 9, 4, 30],
                     top_p=[0.5, 1.0, 1.0, 1.0, 1.0, 0.9, 0.99, 0.2, 0.9, 0.6, 1.0, 0.7, 0.9999, 0.99999],
                     min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.2, 0.05, 0.0, 0.0])
    kept = _kept_by_kernel(logits, rows)
    p, drop = filter_ref(logits, *rows.filters())
    # Tokens with p < 1e-6 (before filtering) are never sampled in practice, and the twin's
    # cumulative sums may drop some of them even at top_p = 1 (their mass above rounds to 1);
    # tokens on the edge of the kept set (within fp32 rounding) may go either way.
    live = torch.softmax(logits.float() / rows.temperature[:, None], dim=-1) > 1e-6
    live &= ~_on_the_edge(p, rows)
    for b in range(n):
        got, want = kept[b][live[b]], ~drop[b][live[b]]
        assert torch.equal(got, want), f"row {b}: {int(got.sum())} kept, want {int(want.sum())}"


def test_empty_kept_set_gives_token_zero(device):
    logits = _logits(3, 700, device)
    rows = Rows.make(3, device, top_p=[0.0, 1.0, 1.0], min_p=[0.0, 1.5, 0.0], top_k=[0, 0, 1])
    got = sample(logits, *rows.args())
    assert got[:2].tolist() == [0, 0]  # nothing survives: the twin's argmax over -inf is 0
    _assert_same_tokens(got, logits, rows)


def test_seed_and_offset_define_the_stream(device):
    logits = torch.zeros(6, 1000, device=device)  # uniform distribution: the token is pure noise
    rows = Rows.make(6, device)
    rows.seeds[:] = 1234
    rows.offsets = torch.tensor([7, 7, 8, 9, 10, 11], device=device)
    got = sample(logits, *rows.args())
    assert got[0] == got[1]
    assert len(set(got[1:].tolist())) == 5  # each offset draws afresh
    again = sample(logits[:1], *Rows(*(t[:1] for t in rows.args())).args())
    assert again[0] == got[0]  # batch composition does not matter


def test_empirical_distribution_matches_filtered_softmax(device):
    """200 seeds of one min-p row over 6 tokens (3 kept) against the filtered softmax. Cheap under
    the interpreter (min-p needs no search); the kept sets themselves are checked exactly above."""
    n, logits_row = 200, torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 1.2])
    logits = logits_row.to(device).expand(n, -1).contiguous()
    rows = Rows.make(n, device, temperature=0.8, min_p=0.3)
    got = sample(logits, *rows.args())
    p, drop = filter_ref(logits[:1], *Rows(*(t[:1] for t in rows.args())).filters())
    expect = torch.where(drop, 0.0, p)[0]
    expect = (expect / expect.sum()).cpu()
    counts = torch.bincount(got.cpu(), minlength=6).double()
    assert counts[expect == 0].sum() == 0
    kept = expect > 0
    chi2 = (((counts - n * expect) ** 2)[kept] / (n * expect[kept])).sum().item()
    dof = int(kept.sum()) - 1
    assert chi2 < 20.0, f"chi2 {chi2:.1f} ({dof} dof): counts {counts.tolist()} vs p {expect.tolist()}"


def test_bad_arguments_raise(device):
    logits = _logits(2, 50, device)
    rows = Rows.make(2, device)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, rows.temperature[:1], *rows.args()[1:])
    with pytest.raises(TypeError, match="top_k"):
        sample(logits, rows.temperature, rows.top_k.float(), *rows.args()[2:])
    with pytest.raises(TypeError, match="logits"):
        sample(logits.double(), *rows.args())
    with pytest.raises(ValueError, match="out"):
        sample(logits, *rows.args(), out=torch.empty(3, dtype=torch.int64, device=device))


@requires_gpu
@pytest.mark.parametrize("shape", ["peaked", "flat"])  # filtered rows: windowed / full passes
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_real_shapes_gpu(batch, shape):
    vocab = 201088
    if shape == "peaked":
        logits = _peaked_logits(batch, vocab, "cuda", torch.bfloat16)
    else:
        logits = _logits(batch, vocab, "cuda", torch.bfloat16, scale=4.0)
    # Row kinds: greedy, temperature, top-k, top-p, min-p; one row runs each kind in turn.
    kind_sets = [torch.tensor([k]) for k in range(5)] if batch == 1 else [torch.arange(batch) % 5]
    for kinds in kind_sets:
        rows = Rows.make(batch, "cuda", temperature=torch.where(kinds == 0, 0.0, 0.9),
                         top_k=torch.where(kinds == 2, 50, 0), top_p=torch.where(kinds == 3, 0.9, 1.0),
                         min_p=torch.where(kinds == 4, 0.05, 0.0))
        _assert_same_tokens(sample(logits, *rows.args()), logits, rows)


@requires_gpu
def test_cuda_graph_replay_and_no_sync():
    batch, vocab = 16, 201088
    logits = _logits(batch, vocab, "cuda", torch.bfloat16)
    top_p = torch.where(torch.arange(batch) % 2 == 0, 0.9, 1.0)
    rows = Rows.make(batch, "cuda", temperature=0.7, top_p=top_p)
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    sample(logits, *rows.args(), out=out)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sample(logits, *rows.args(), out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step in range(4):  # windowed and full-pass filtered rows replay the same graph
        fresh = _peaked_logits if step % 2 else _logits
        logits.copy_(fresh(batch, vocab, "cuda", torch.bfloat16))
        rows.offsets += 1
        graph.replay()
        _assert_same_tokens(out, logits, rows)
