"""A/B timing of options that are off by default, on one random checkpoint (H200 machine).

    PYTHONPATH=src python scripts/ab_options.py [--model 20b] [--engine FIELD=VALUE ...] ...
                                                [--prefill-moe FIELD=VALUE ...] [--rounds 2]

--engine: GpuEngineConfig fields of one more side (B, C, ... in the order given; A is the
defaults), and MoeConfig fields for decode-sized steps written moe.FIELD=VALUE (pick_config's
choice for T <= 64, patched while the side's engine captures its graphs and decodes). They shape
the captured decode graphs, so each side gets its own engine, on fresh weights (the engine takes
over the tensors it is given), built in turn (A, B, C, A, B, C, ...), and each engine times
decode after a 128-token prompt (batch 1, or --batch).
--prefill-moe: MoeConfig fields for steps of more than 64 tokens (e.g. scale_words=1). Prompt
steps run eagerly, so the defaults and these fields alternate on side A's engines: TTFT of a
4,096-token prompt, each time a new prompt (no prefix-cache hits).
--base: GpuEngineConfig fields of every side, A included (e.g. moe_frag_scales=1, which the
prefill field scale_unpack=frag needs).
Prints one row per measurement and a summary of medians per side.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch
from gpu_check import _bench_engine, _prompts, _release, row
from profile_decode import engine_options, moe_changes_apply, moe_fields

DECODE_TOKENS = 64  # steps of at most this many tokens are decode-sized (graph-captured)


class MoePatch:
    """Switches kernels.moe.pick_config between its own choice and `changes` for steps of
    `tokens` (a range of token counts) while `on`."""

    def __init__(self, changes: dict, tokens: range):
        from gptoss_cli.kernels import moe

        self.base, self.changes, self.tokens, self.on = moe.pick_config, changes, tokens, False
        moe.pick_config = self._pick

    def _pick(self, num_tokens: int, num_experts: int, top_k: int, frag_scales: bool = False):
        cfg = self.base(num_tokens, num_experts, top_k, frag_scales)
        applies = self.on and num_tokens in self.tokens and moe_changes_apply(cfg, self.changes)
        return dataclasses.replace(cfg, **self.changes) if applies else cfg


def ttft_ms(eng, length: int, seed: int) -> float:
    from gptoss_cli.runtime.api import SamplingParams

    prompt = _prompts(1, [length], seed=seed)[0]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    return (out.timings.first_token - out.timings.arrival) * 1e3


def _side(pairs: list[str]) -> tuple[dict, dict]:
    """(GpuEngineConfig fields, MoeConfig fields for decode steps) of one side's FIELD=VALUE pairs;
    MoeConfig fields are written moe.FIELD=VALUE."""
    moe = [p.removeprefix("moe.") for p in pairs if p.startswith("moe.")]
    return engine_options([p for p in pairs if not p.startswith("moe.")]), moe_fields(moe, "--engine moe.")


def _describe(options: tuple[dict, dict]) -> str:
    engine, moe = options
    return ", ".join([f"{k}={v}" for k, v in engine.items()] + [f"moe.{k}={v}" for k, v in moe.items()]) or "defaults"


def _prefill_rounds(eng, prefill: MoePatch, length: int, seed: int, ttft: dict, label: str) -> int:
    """TTFT with the defaults and with the fields, alternating (ABBA); returns the next seed."""
    ttft_ms(eng, length, seed)  # compile both prompt paths before timing
    prefill.on = True
    ttft_ms(eng, length, seed + 1)
    for which in ("defaults", "fields", "fields", "defaults"):
        prefill.on = which == "fields"
        seed += 2
        ttft[which].append(ttft_ms(eng, length, seed))
        row(label, f"TTFT {length} prefill MoE {which}", f"{ttft[which][-1]:.1f} ms")
    prefill.on = False
    return seed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", choices=["tiny", "20b", "120b"])
    parser.add_argument("--engine", nargs="*", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--prefill-moe", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--base", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="decode batch (each request its own seed)")
    parser.add_argument("--prompt", type=int, default=4096, help="TTFT prompt length")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from gptoss_cli.runtime.gpu.engine import GpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    sides = {"A": ({}, {})} | {chr(ord("B") + i): _side(opts) for i, opts in enumerate(args.engine)}
    prefill = MoePatch(moe_fields(args.prefill_moe, "--prefill-moe"), range(DECODE_TOKENS + 1, 1 << 30))
    decode_moe = MoePatch({}, range(1, DECODE_TOKENS + 1))  # a side's fields while its graphs are captured
    decode = {side: [] for side in sides}
    ttft = {"defaults": [], "fields": []}
    seed = 1000
    for rnd in range(args.rounds):
        for side, (options, moe_changes) in sides.items():
            decode_moe.changes, decode_moe.on = moe_changes, True
            eng = GpuEngine(random_weights(args.model, device="cuda"), max_batch=args.batch,
                            **(engine_options(args.base) | options))
            decode[side].append(_bench_engine(f"{side} round {rnd}", eng, args.batch, 128, 256))
            decode_moe.on = False
            if prefill.changes and side == "A":
                seed = _prefill_rounds(eng, prefill, args.prompt, seed, ttft, f"{side} round {rnd}")
            del eng
            _release()
    print()
    for side, options in sides.items():
        print(f"{side} ({_describe(options)}): batch-{args.batch} decode median {statistics.median(decode[side]):,.1f} tok/s "
              f"over {decode[side]}")
    for which, times in ttft.items():
        if times:
            print(f"prefill MoE {which} ({prefill.changes if which == 'fields' else 'pick_config'}): TTFT "
                  f"{args.prompt} median {statistics.median(times):.1f} ms over {[round(t, 1) for t in times]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
