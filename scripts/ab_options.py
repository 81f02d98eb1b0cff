"""A/B timing of options that are off by default, on one random checkpoint (H200 machine).

    PYTHONPATH=src python scripts/ab_options.py [--model 20b] [--engine FIELD=VALUE ...]
                                                [--prefill-moe FIELD=VALUE ...] [--rounds 2]

--engine: GpuEngineConfig fields for side B. They shape the captured decode graphs, so each side
gets its own engine, built in turn (A, B, A, B, ...), and each engine times batch-1 decode after
a 128-token prompt.
--prefill-moe: MoeConfig fields for steps of more than 64 tokens (e.g. scale_words=1). Prompt
steps run eagerly, so A and B alternate on every engine: TTFT of a 4,096-token prompt, each
time a new prompt (no prefix-cache hits).
Prints one row per measurement and a summary of medians per side.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch
from gpu_check import _bench_engine, _prompts, _release, row
from profile_decode import engine_options, moe_fields


class PrefillMoe:
    """Switches kernels.moe.pick_config between its own choice and `changes` for T > 64."""

    def __init__(self, changes: dict):
        from gptoss_cli.kernels import moe

        self.moe, self.base, self.changes, self.on = moe, moe.pick_config, changes, False
        moe.pick_config = self._pick

    def _pick(self, num_tokens: int, num_experts: int, top_k: int):
        cfg = self.base(num_tokens, num_experts, top_k)
        return dataclasses.replace(cfg, **self.changes) if self.on and num_tokens > 64 else cfg


def ttft_ms(eng, length: int, seed: int) -> float:
    from gptoss_cli.runtime.api import SamplingParams

    prompt = _prompts(1, [length], seed=seed)[0]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    return (out.timings.first_token - out.timings.arrival) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", choices=["tiny", "20b", "120b"])
    parser.add_argument("--engine", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--prefill-moe", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=4096, help="TTFT prompt length")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from gptoss_cli.runtime.gpu.engine import GpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    options_b = engine_options(args.engine)
    prefill = PrefillMoe(moe_fields(args.prefill_moe, "--prefill-moe"))
    weights = random_weights(args.model, device="cuda")
    decode = {"A": [], "B": []}
    ttft = {"A": [], "B": []}
    seed = 1000
    for rnd in range(args.rounds):
        for side in ("A", "B") if options_b else ("A",):
            eng = GpuEngine(weights, max_batch=1, **(options_b if side == "B" else {}))
            decode[side].append(_bench_engine(f"{side} round {rnd}", eng, 1, 128, 256))
            if prefill.changes:
                ttft_ms(eng, args.prompt, seed)  # compile both prompt paths before timing
                prefill.on = True
                ttft_ms(eng, args.prompt, seed + 1)
                for prefill_side in ("A", "B", "B", "A"):
                    prefill.on = prefill_side == "B"
                    seed += 2
                    ttft[prefill_side].append(ttft_ms(eng, args.prompt, seed))
                    row(f"{side} round {rnd}", f"TTFT {args.prompt} prefill {prefill_side}",
                        f"{ttft[prefill_side][-1]:.1f} ms")
                prefill.on = False
            del eng
            _release()
    print(f"\nB engine options: {options_b or 'none'}; B prefill MoE fields: {prefill.changes or 'none'}")
    for side in ("A", "B"):
        if decode[side]:
            print(f"{side}: batch-1 decode median {statistics.median(decode[side]):,.1f} tok/s over {decode[side]}")
        if ttft[side]:
            print(f"{side}: TTFT {args.prompt} median {statistics.median(ttft[side]):.1f} ms over "
                  f"{[round(t, 1) for t in ttft[side]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
