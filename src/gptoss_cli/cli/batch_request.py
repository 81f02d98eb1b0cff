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
from .sampling_settings import SamplingSettings

# Settings newer than the resume sidecar, with the value that means "not used".
_ADDED_LATER = {"stop": [], "repetition_penalty": SamplingParams.repetition_penalty}
# Seeds stay below 2**53 so that JSON readers that parse numbers as doubles keep them exact.
_SEED_BITS = 53


@dataclass
class RunDefaults(SamplingSettings):
    """The command line's sampling, effort and stop defaults (recorded in the resume sidecar)."""

    effort: str = "medium"
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        SamplingParams(**self.sampling_values())  # ValueError names a bad flag's field

    def to_dict(self) -> dict:
        """As JSON keeps it (stop as a list). Settings added after the sidecar format are left out
        at their defaults, so that older sidecars still match a run that does not use them."""
        data = asdict(self) | {"stop": list(self.stop)}
        return {k: v for k, v in data.items() if k not in _ADDED_LATER or v != _ADDED_LATER[k]}


def effort_for(spec: RequestSpec, defaults: RunDefaults) -> str | None:
    """The reasoning effort a request runs with; None for raw text (no system message)."""
    if spec.kind == "text":
        return None
    return spec.effort or defaults.effort


def stop_for(spec: RequestSpec, defaults: RunDefaults) -> tuple[str, ...]:
    """The line's own stop sequences (an empty list: none), else --stop."""
    return defaults.stop if spec.stop is None else spec.stop


def sampling_for(spec: RequestSpec, defaults: RunDefaults) -> SamplingParams:
    """Line overrides on top of the defaults, with a concrete seed."""
    values = defaults.sampling_values()
    values.update(spec.sampling)
    if values["seed"] is None:
        values["seed"] = secrets.randbits(_SEED_BITS)
    return SamplingParams(**values)


def prompt_ids(spec: RequestSpec, tokenizer, effort: str | None) -> list[int]:
    """The token ids the engine continues from."""
    if spec.kind == "text":
        return tokenizer.encode(spec.text or "")
    return render_prompt(tokenizer, list(spec.messages), SystemConfig(reasoning_effort=effort), spec.developer)
