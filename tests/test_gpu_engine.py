"""The GPU engine's code path end to end on random:tiny. On a CPU-only machine the Triton
kernels run in the interpreter (eager path, no CUDA graphs); on a GPU the same tests also
exercise graph replay. The oracle is the fp32 reference model."""

import numpy as np
import pytest
import torch

from gptoss_cli.runtime.api import SamplingParams
from gptoss_cli.runtime.gpu import model as gpu_model
from gptoss_cli.runtime.gpu.engine import GpuEngine
from gptoss_cli.runtime.gpu.kv_cache import sliding_blocks_needed
from gptoss_cli.runtime.model_ref import ReferenceModel
from gptoss_cli.runtime.random_checkpoint import random_weights
from helpers import max_rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 everywhere: exact against the fp32 reference in the interpreter, tf32-close on a GPU
DTYPE = torch.float32
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _engine(weights=None, **opts):
    opts = {"max_batch": 4, "max_step_tokens": 256, "block_size": 16, "kv_memory_bytes": 64 << 20, "max_context": 512,
            "cuda_graphs": DEVICE == "cuda",
            "dtype": str(DTYPE).removeprefix("torch."), **opts}
    return GpuEngine(weights or random_weights("tiny", seed=5, device=DEVICE), **opts)


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def ref():
    return ReferenceModel(random_weights("tiny", seed=5, device=DEVICE), dtype=torch.float32)


def _prompt(n, seed):
    return torch.randint(0, 199998, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_greedy(ref, prompt, n):
    cache, ids, out = ref.new_cache(), prompt, []
    for _ in range(n):
        tok = int(ref.forward([(ids, cache)])[0].argmax())
        out.append(tok)
        ids = [tok]
    return out


def test_prefill_logits_match_reference(engine, ref):
    p = _prompt(150, 1)  # crosses the 128-key window and several 16-token blocks
    got = engine.score(p)
    want = ref.forward([(p, ref.new_cache())], all_logits=True)
    tol = 1e-3 if DEVICE == "cuda" else 1e-4  # fp32 everywhere; cuBLAS vs Triton summation order
    assert max_rel_err(got, want) <= tol


def test_fragment_order_scales_prefill_matches_reference(ref, monkeypatch):
    # The engine's weights hold the experts' fragment-order scales (GpuEngineConfig.moe_frag_scales,
    # on by default), and a prompt on the prefill tiles (8 experts, ~75 rows each: 128-row tiles)
    # reads them in both gemms (MoeConfig.scale_unpack / scale_unpack2 "frag"): same logits.
    from gptoss_cli.kernels import moe

    pick, unpacks = moe.pick_config, []

    def spy(t, e, k, frag_scales=False):
        config = pick(t, e, k, frag_scales)
        unpacks.append((config.scale_unpack, config.gemm2_scale_unpack))
        return config

    monkeypatch.setattr(moe, "pick_config", spy)
    eng = _engine()
    assert eng.runner.model.w.layers[0].experts.w1_scales_frag is not None
    p = _prompt(150, 1)
    got = eng.score(p)
    assert ("frag", "frag") in unpacks  # the prompt ran on the prefill tiles with fragment-order scales
    want = ref.forward([(p, ref.new_cache())], all_logits=True)
    assert max_rel_err(got, want) <= (1e-3 if DEVICE == "cuda" else 1e-4)
    plain = _engine(moe_frag_scales=False).runner.model.w.layers[0].experts
    assert plain.w1_scales_frag is None and plain.w2_scales_frag is None


def test_split_copy_gives_the_same_tokens():
    # GpuEngineConfig.moe_split_copy: the decode tiles read the experts' split-word copy (on a GPU in
    # bf16; the interpreter's kernels decode bytes and never read it). Greedy tokens are the same
    # either way at a batch whose decode steps run the tiles (8 experts: no grouped kernels).
    prompts = [_prompt(5 + 3 * i, 40 + i) for i in range(6)]
    runs = {}
    for split in (True, False):
        eng = _engine(moe_split_copy=split, dtype="bfloat16", max_batch=8)
        experts = eng.runner.model.w.layers[0].experts
        assert (experts.w1_split is not None and experts.w2_split is not None) is split
        runs[split] = [out.token_ids for out in eng.generate(prompts, GREEDY)]
    assert runs[True] == runs[False]


def test_padded_prompt_steps_match_reference():
    # A step that is one sequence's whole prompt runs padded to its length bucket (a CUDA graph on
    # a GPU; here the same padded step eagerly): greedy tokens as the reference's, for lengths on
    # and off the buckets, and for a prompt whose prefix is cached (the chunk attends to context
    # it did not write). Pad tokens write K/V to scratch block 0 only: the cached prefix must
    # survive them.
    eng = _engine()
    eng.runner.pad_prompts = True
    ref = ReferenceModel(random_weights("tiny", seed=5, device=DEVICE), dtype=torch.float32)
    base = _prompt(40, 11)
    for p in (_prompt(3, 9), _prompt(16, 10), base, base + _prompt(9, 12)):
        assert eng.generate([p], GREEDY)[0].token_ids == _ref_greedy(ref, p, GREEDY.max_tokens)
    assert eng.runner.prompt_bucket(_seq_stub(40), 40) == 64 and eng.runner.prompt_bucket(_seq_stub(40), 39) is None


def _seq_stub(n):
    from gptoss_cli.runtime.api import RequestOutput
    from gptoss_cli.runtime.gpu.sequence import Sequence

    return Sequence(RequestOutput("stub", [0] * n), GREEDY, 0, 1, tokens=[0] * n)


def test_greedy_batched_matches_reference_and_single(engine, ref):
    prompts = [_prompt(n, n) for n in (3, 40)]
    start = engine.free_blocks()
    batched = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert engine.free_blocks() == start  # nothing leaked (cached blocks count as free)
    assert batched == [_ref_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert engine.generate([prompts[1]], GREEDY)[0].token_ids == batched[1]


def test_prefix_cache_reuse_gives_same_tokens(engine, ref):
    base = _prompt(36, 7)
    engine.generate([base], GREEDY)
    follow = base + _prompt(5, 8)
    cached = engine.generate([follow], GREEDY)[0]
    assert cached.cached_prompt_tokens == 32  # two full 16-token blocks, in both pools
    assert cached.token_ids == _ref_greedy(ref, follow, GREEDY.max_tokens)


def test_chunked_prefill_and_preemption_keep_tokens(ref):
    prompts = [_prompt(40, 20 + i) for i in range(2)]
    # 5 usable full-layer blocks cannot hold both 43-token sequences (3 blocks each): the newer
    # one is preempted and recomputed.
    cfg = random_weights("tiny").config
    per_block = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(DTYPE).bits // 8
    budget = (sliding_blocks_needed(cfg, 16, 4, 16) + 6) * per_block * 2  # 2 sliding + 2 full layers
    small = _engine(max_step_tokens=16, kv_memory_bytes=budget, max_context=64)
    out = [o.token_ids for o in small.generate(prompts, GREEDY)]
    assert small.scheduler.num_preemptions > 0
    assert out == [_ref_greedy(ref, p, GREEDY.max_tokens) for p in prompts]


def test_warm_up_step_sizes_cover_every_compile_class():
    from gptoss_cli.kernels.moe import pick_config
    from gptoss_cli.runtime.gpu.warmup import step_sizes

    sizes = step_sizes(8192, 32, 4)
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 8192 and len(sizes) < 20

    def key(t):
        return pick_config(t, 32, 4), t == 1, t % 16 == 0

    warmed = {key(t) for t in sizes}
    assert all(key(t) in warmed for t in range(1, 8193))


def test_warm_up_leaves_the_engine_idle_with_every_block_free(engine):
    # On the CPU the warm-up is off by default (interpreter steps cost seconds); forced here, small.
    warmed = _engine(max_step_tokens=8, warm_up=True)
    assert not warmed.has_unfinished() and warmed.num_steps == 0
    assert warmed.kv.full.num_cached == 0 and warmed.kv.slide.num_cached == 0
    assert warmed.free_blocks() == (warmed.kv.full.num_blocks - 1, warmed.kv.slide.num_blocks - 1)
    prompt = _prompt(6, seed=11)
    out = warmed.generate([prompt], GREEDY)[0]
    assert out.cached_prompt_tokens == 0
    assert out.token_ids == engine.generate([prompt], GREEDY)[0].token_ids


class _EagerGraph:
    """On a CPU, a decode "graph" whose replay runs the captured body eagerly: the same static
    buffers and in-place token feedback as a CUDA graph, so the graph and overlap paths run."""

    def __init__(self, runner, bucket):
        self.runner, self.bucket = runner, bucket

    def replay(self):
        self.runner._decode_body(self.bucket)


def _graph_engine(**opts):
    """An engine whose decode steps take the graph path, on a CPU through _EagerGraph."""
    eng = _engine(**opts)
    if DEVICE == "cpu":
        eng.runner.use_graphs = True
        eng.runner._graphs = {b: _EagerGraph(eng.runner, b) for b in eng.runner.buckets}
    return eng


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_graph_path_and_overlapped_steps_match_reference(ref, overlap):
    eng = _graph_engine(overlap_steps=overlap, max_batch=2)
    prompts = [_prompt(n, 30 + n) for n in (5, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = [o.token_ids for o in eng.generate(prompts, params)]
    assert out == [_ref_greedy(ref, p, 5) for p in prompts]
    assert eng.runner._graph_seqs is not None  # decode steps went through the graph path


def test_fused_qkv_rope_batch1_decode_matches_reference(ref, monkeypatch):
    # One sequence: every decode step is one token, so the qkv projection, RoPE and the K/V
    # cache write run as the single kernels.qkv_rope launch (on the CPU through the graph path).
    calls = []
    fused = gpu_model.qkv_rope_store
    monkeypatch.setattr(gpu_model, "qkv_rope_store", lambda *a, **k: calls.append(1) or fused(*a, **k))
    eng = _graph_engine(fused_qkv_rope=True, max_batch=1)
    prompt = _prompt(9, 41)
    # 3 tokens: two decode steps, so the second reads K/V that the first stored
    assert eng.generate([prompt], GREEDY)[0].token_ids == _ref_greedy(ref, prompt, GREEDY.max_tokens)
    assert eng.runner._graph_seqs is not None
    assert len(calls) >= eng.config.num_hidden_layers  # every layer of a decode step (or its capture)


def test_split_decode_attention_in_the_graph_matches_reference(ref):
    # max_context 1,024: the bucket of one decodes its full-attention layers with two splits and
    # the reduce launch (at 512 every split count is one), through the graph path.
    eng = _graph_engine(max_batch=1, max_context=1024)
    assert eng.runner._splits[1][0] == 2
    prompt = _prompt(9, 43)
    assert eng.generate([prompt], GREEDY)[0].token_ids == _ref_greedy(ref, prompt, GREEDY.max_tokens)


def test_router_topk_batch1_decode_matches_reference(ref, monkeypatch):
    # pick_config takes the top-k in gemv1 at T = 1 (MoeConfig.gemv_topk); the router's own top-k
    # (its arrival counter and serial tail) stays a supported path: batch-1 decode through the
    # graph path with it equals the reference too.
    import dataclasses

    from gptoss_cli.kernels import moe

    pick = moe.pick_config
    assert pick(1, 32, 4).gemv_topk
    monkeypatch.setattr(moe, "pick_config", lambda t, e, k, frag=False: dataclasses.replace(
        pick(t, e, k, frag), gemv_topk=False) if t == 1 else pick(t, e, k, frag))
    eng = _graph_engine(max_batch=1)
    prompt = _prompt(9, 47)
    assert eng.generate([prompt], GREEDY)[0].token_ids == _ref_greedy(ref, prompt, GREEDY.max_tokens)
    assert eng.runner._graph_seqs is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the mma gemv is inline PTX: GPU only")
def test_mma_gemv_batch1_decode_matches_reference(monkeypatch):
    # The tensor-core gemv needs bf16 activations (the other tests here run the engine in fp32), and
    # random:tiny's K = 128 is shorter than pick_config's gemv1 K step: with K steps of 64 (and
    # 64-row programs, which that K step needs), a bf16 engine's batch-1 steps run gemv1 on the
    # tensor cores (MoeConfig.gemv_mma), loads two steps ahead, through the prompt and decode
    # graphs. The confident readout keeps greedy tokens above bf16 noise.
    import dataclasses

    from gptoss_cli.kernels import moe, moe_gemv

    pick = moe.pick_config
    assert pick(1, 32, 4).gemv_mma
    runs = []
    plan = moe_gemv.mma_plan
    monkeypatch.setattr(moe_gemv, "mma_plan", lambda *a: runs.append(plan(*a)) or runs[-1])
    monkeypatch.setattr(moe, "pick_config", lambda t, e, k, frag=False: dataclasses.replace(
        pick(t, e, k, frag), block_k=64, block_n1=32) if t == 1 else pick(t, e, k, frag))
    ref = ReferenceModel(random_weights("tiny", seed=6, device=DEVICE, confident=True), dtype=torch.float32)
    eng = _engine(max_batch=1, dtype="bfloat16", weights=random_weights("tiny", seed=6, device=DEVICE, confident=True))
    prompts = [_prompt(9, 53), _prompt(30, 54)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == [_ref_greedy(ref, p, 8) for p in prompts]
    assert eng.runner._graph_seqs is not None
    assert (2, 2) in runs  # (K splits, steps ahead) of gemv1's 64-row programs; 0 splits: packed fp16


def test_128_experts_like_120b_match_reference():
    # gpt-oss-120b differs from 20b in its 128 experts (and 36 layers): the routing and tile tables
    # with most experts empty (prefill), and at T = 1 the fused router with the top-k in gemv1 over
    # 128 logits, at tiny widths, against the reference.
    import dataclasses

    from gptoss_cli.runtime.random_checkpoint import build_random_weights, random_config

    cfg = dataclasses.replace(random_config("tiny"), num_local_experts=128)
    # Two builds: the engine takes over the tensors it is given.
    ref128 = ReferenceModel(build_random_weights(cfg, seed=9, device=DEVICE), dtype=torch.float32)
    eng = GpuEngine(build_random_weights(cfg, seed=9, device=DEVICE), max_batch=1, max_step_tokens=64, block_size=16, kv_memory_bytes=16 << 20,
                    max_context=128, cuda_graphs=DEVICE == "cuda", dtype=str(DTYPE).removeprefix("torch."))
    p = _prompt(12, 51)
    tol = 1e-3 if DEVICE == "cuda" else 1e-4
    assert max_rel_err(eng.score(p), ref128.forward([(p, ref128.new_cache())], all_logits=True)) <= tol
    assert eng.generate([p], GREEDY)[0].token_ids == _ref_greedy(ref128, p, GREEDY.max_tokens)


def _ref_greedy_penalised(ref, prompt, n, penalty):
    """Greedy decoding with the repetition penalty over the prompt and the tokens so far, on the
    reference's logits (kernels.penalty's twin)."""
    from gptoss_cli.kernels.penalty import apply_penalty_mask_ref

    cache, ids, out = ref.new_cache(), prompt, []
    for _ in range(n):
        logits = ref.forward([(ids, cache)])[0]
        seen = torch.zeros(1, logits.shape[0], dtype=torch.bool)
        seen[0, prompt + out] = True
        tok = int(apply_penalty_mask_ref(logits[None].cpu(), seen, torch.tensor([penalty]))[0].argmax())
        out.append(tok)
        ids = [tok]
    return out


def _run_each(eng, requests):
    """Token ids of (prompt, params) requests run together, in order."""
    rids = [eng.add_request(p, sp) for p, sp in requests]
    done = {}
    while eng.has_unfinished():
        for event in eng.step():
            if event.output is not None:
                done[event.request_id] = event.output.token_ids
    return [done[r] for r in rids]


@pytest.mark.parametrize("path", ["eager", "graphs", "overlap"])
def test_repetition_penalty_matches_reference(ref, path):
    # Three requests in one batch: penalties above and below 1 and none. "graphs": the prompt
    # steps run padded (prompt graphs) and the decode steps through the graph path, where the
    # penalty and the seen-set marks are part of the captured body.
    eng = _engine(max_batch=4) if path == "eager" else _graph_engine(max_batch=4, overlap_steps=path == "overlap")
    eng.runner.pad_prompts = path != "eager"
    n = 6
    base = _prompt(12, 60)
    # The first prompt starts with the token greedy decoding picks after it, so that a penalty
    # above 1 has a seen token to push down (a random model rarely repeats by itself).
    prompts = [_ref_greedy(ref, base, 1) + base, _prompt(30, 61), _prompt(7, 62)]
    penalties = [3.0, 0.2, 1.0]
    got = _run_each(eng, [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, repetition_penalty=r))
                          for p, r in zip(prompts, penalties)])
    want = [_ref_greedy_penalised(ref, p, n, r) for p, r in zip(prompts, penalties)]
    assert got == want
    plain = [_ref_greedy(ref, p, n) for p in prompts[:2]]
    assert got[0] != plain[0] and got[1] != plain[1]  # the penalty changed what greedy picks
    if path != "eager":
        assert eng.runner._graph_seqs is not None
    _check_seen_rows(eng, prompts[:2], got[:2], exact=path != "overlap")


def _check_seen_rows(eng, prompts, outputs, exact, rows_held=None):
    """Each penalised sequence's row of seen-set bits holds its prompt and every token it sampled
    (on the device, after each sample), for the sequences still holding a row (`rows_held` of
    them; default all). With overlapped steps one more launched step may have sampled (and
    marked) a token the engine then dropped."""
    from gptoss_cli.kernels.penalty import seen_words

    seen = eng.runner.seen
    held = {}
    for row in range(seen.bits.shape[0]):
        seq = seen.holder(row)
        if seq is not None:
            held[tuple(seq.out.prompt_token_ids)] = seen.bits[row].cpu().numpy()
    assert len(held) == (rows_held or len(prompts))  # rows are built only for sequences with a penalty
    for prompt, out in zip(prompts, outputs):
        if tuple(prompt) not in held:
            continue
        got, want = held[tuple(prompt)], seen_words(prompt + out, seen.vocab)
        extra = np.unpackbits((got & ~want).view(np.uint8)).sum()
        assert (got & want == want).all() and extra <= (0 if exact else 1)


def test_repetition_penalty_survives_preemption(ref):
    # The newer sequence is preempted and recomputed; its seen set must again hold its prompt and
    # the tokens it had generated (rebuilt on the host when its row's bits describe another sequence).
    prompts = [_prompt(40, 70 + i) for i in range(2)]
    cfg = random_weights("tiny").config
    per_block = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(DTYPE).bits // 8
    budget = (sliding_blocks_needed(cfg, 16, 4, 16) + 6) * per_block * 2
    small = _engine(max_step_tokens=16, kv_memory_bytes=budget, max_context=64)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, repetition_penalty=0.3)
    out = _run_each(small, [(p, sp) for p in prompts])
    assert small.scheduler.num_preemptions > 0
    assert out == [_ref_greedy_penalised(ref, p, 3, 0.3) for p in prompts]
    # The recomputed sequence takes the lowest free row, the finished first one's: one row is held.
    _check_seen_rows(small, prompts, out, exact=True, rows_held=1)
