"""The sampling settings a user chooses: `gptoss run`'s command-line defaults (RunDefaults) and
`gptoss chat`'s settings (ChatSettings, changeable with /set) share this declaration, with the
defaults of runtime.api.SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.api import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens")


@dataclass
class SamplingSettings:
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    min_p: float = SamplingParams.min_p
    repetition_penalty: float = SamplingParams.repetition_penalty
    seed: int | None = SamplingParams.seed
    max_tokens: int | None = SamplingParams.max_tokens

    def sampling_values(self) -> dict:
        """The settings by name, as SamplingParams takes them."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}
