"""Load check on the GPU engine (random:tiny, fp32), CPU-sized: requests of random lengths and sampling
settings arrive while others run; each output equals the same request run alone, and no KV block
leaks. On a CPU-only machine the Triton kernels run in the interpreter at 3-13 s per engine step,
and the alone runs cost one step per generated token, so this stays small (under a minute); the
1,000-request version runs on the H200 (scripts/gpu_check.py, section "load")."""

import torch
from engine_load import make_requests, run_load_check

from gptoss_cli.runtime.gpu.engine import GpuEngine
from gptoss_cli.runtime.random_checkpoint import random_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32  # exact in the interpreter, as in test_gpu_engine.py


def _engine(**opts):
    opts = {"max_batch": 4, "max_step_tokens": 64, "block_size": 16, "kv_memory_bytes": 64 << 20, "max_context": 512,
            "cuda_graphs": DEVICE == "cuda",
            "dtype": str(DTYPE).removeprefix("torch."), **opts}
    return GpuEngine(random_weights("tiny", seed=5, device=DEVICE), **opts)


def test_load_outputs_equal_alone_runs_and_blocks_return():
    # Five requests (prompts <= 40 tokens, <= 3 new), two queued per step. Seed 1129 gives, in two
    # load steps: a greedy 31-token prompt prefilled, then decoding next to two new prefills (a
    # sampled prompt that reuses its first 16-token block from the prefix cache while it runs, and
    # a sampled one aborted after its first token); two more aborted while still waiting. Each
    # engine step costs 3-13 s in the interpreter and only completed requests are rerun alone, so
    # this is ~5 steps (~35-50 s here); many more requests run on the H200.
    requests = make_requests(5, seed=1129, max_prompt=40, max_new=3, filter_prob=0.0, shared_prefix=0.4,
                             abort_fraction=0.4)
    report = run_load_check(_engine(), requests=requests, initial=2, per_step=2)
    assert report.errors == [], report.summary()
    assert report.greedy_mismatches == [], report.summary()
    assert report.sampled_mismatches == [], report.summary()
    assert report.blocks_restored, report.summary()
    # the load really mixed things: the checks above would pass vacuously otherwise
    assert report.greedy_compared >= 1 and report.sampled_compared >= 1 and report.aborted == 3, report.summary()
    assert report.mixed_steps >= 1 and report.max_concurrent >= 3 and report.cached_prompt_tokens >= 16, \
        report.summary()
