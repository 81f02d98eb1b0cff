"""From a validated batch line to what the engine takes: prompt token ids and SamplingParams.

Precedence for every setting: the line's own value, then the command-line default. Seeds: line
seed > --seed > a fresh random one, which is recorded so any record can be reproduced.
Chat shapes are rendered with harmony; raw `text` lines are encoded as they are (no template).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass

from ..runtime.api import SamplingParams
from ..runtime.harmony import SystemConfig, render_prompt
from .batch_input import RequestSpec

# Seeds stay below 2**53 so that JSON readers that parse numbers as doubles keep them exact.
_SEED_BITS = 53


@dataclass(frozen=True)
class RunDefaults:
    """The command line's sampling and effort defaults (recorded in the resume sidecar)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    effort: str = "medium"

    def to_dict(self) -> dict:
        return asdict(self)


def effort_for(spec: RequestSpec, defaults: RunDefaults) -> str | None:
    """The reasoning effort a request runs with; None for raw text (no system message)."""
    if spec.kind == "text":
        return None
    return spec.effort or defaults.effort


def sampling_for(spec: RequestSpec, defaults: RunDefaults) -> SamplingParams:
    """Line overrides on top of the defaults, with a concrete seed."""
    values = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "min_p": defaults.min_p,
        "seed": defaults.seed,
        "max_tokens": defaults.max_tokens,
    }
    values.update(spec.sampling)
    if values["seed"] is None:
        values["seed"] = secrets.randbits(_SEED_BITS)
    return SamplingParams(**values)


def prompt_ids(spec: RequestSpec, tokenizer, effort: str | None) -> list[int]:
    """The token ids the engine continues from."""
    if spec.kind == "text":
        return tokenizer.encode(spec.text or "")
    return render_prompt(tokenizer, list(spec.messages), SystemConfig(reasoning_effort=effort), spec.developer)
