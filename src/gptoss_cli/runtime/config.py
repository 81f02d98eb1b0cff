"""Model configuration read from a checkpoint's config.json and generation_config.json.

Field names follow the Hugging Face files exactly. Both `rope_scaling` (as released) and
`rope_parameters` (transformers >= 5 re-saves) spellings are accepted. Nothing here touches torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (gpt-oss-model.md §2.4); `truncate=False` keeps low/high unrounded."""

    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False
    rope_type: str = "yarn"

    @property
    def attention_factor(self) -> float:
        """The concentration that multiplies both cos and sin."""
        return 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one gpt-oss checkpoint (HF config.json names)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    rope_theta: float = 150000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    eos_token_id: int = 200002
    pad_token_id: int = 199999
    model_type: str = "gpt_oss"

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        p = []
        if len(self.layer_types) != self.num_hidden_layers:
            p.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            p.append(f"unknown layer type in {sorted(set(self.layer_types))}")
        if self.num_attention_heads % self.num_key_value_heads:
            p.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % 32 or self.intermediate_size % 32:
            p.append("hidden_size and intermediate_size must be multiples of 32 (MXFP4 blocks)")
        if self.head_dim % 2:
            p.append("head_dim must be even (half-split RoPE)")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            p.append("num_experts_per_tok must be in 1..num_local_experts")
        if self.tie_word_embeddings:
            p.append("tie_word_embeddings=true is not gpt-oss")
        return p

    # ---- derived sizes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    # ---- (de)serialisation ----------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict; raises ValueError naming what is wrong."""
        if d.get("model_type") != "gpt_oss":
            raise ValueError(f"model_type is {d.get('model_type')!r}, expected 'gpt_oss'")
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 150000.0))
        if rope.get("rope_type", rope.get("type", "yarn")) != "yarn":
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not yarn")
        rope_fields = {k: rope[k] for k in RopeScaling.__dataclass_fields__ if k in rope}
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("rope_scaling", "rope_theta")}
        if "num_local_experts" not in known and "num_experts" in d:
            known["num_local_experts"] = d["num_experts"]
        if "num_experts_per_tok" not in known and "experts_per_token" in d:
            known["num_experts_per_tok"] = d["experts_per_token"]
        if "layer_types" in known:
            known["layer_types"] = tuple(known["layer_types"])
        for key in ("eos_token_id", "pad_token_id"):
            if isinstance(known.get(key), list) and known[key]:
                known[key] = known[key][0]
        _check_types(known, rope_fields, theta)
        return cls(**known, rope_theta=float(theta), rope_scaling=RopeScaling(**rope_fields))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face gpt-oss checkpoint carries (as released)."""
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d.pop("swiglu_alpha")
        d.update(
            architectures=["GptOssForCausalLM"],
            experts_per_token=self.num_experts_per_tok,
            initial_context_length=self.rope_scaling.original_max_position_embeddings,
            attention_dropout=0.0,
            hidden_act="silu",
            initializer_range=0.02,
            output_router_logits=False,
            router_aux_loss_coef=0.9,
            use_cache=True,
            quantization_config={
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            },
        )
        return d


_INT_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
               "max_position_embeddings", "eos_token_id", "pad_token_id", "original_max_position_embeddings"}
_FLOAT_FIELDS = {"rms_norm_eps", "swiglu_limit", "swiglu_alpha", "factor", "beta_fast", "beta_slow"}


def _check_types(fields: dict[str, Any], rope: dict[str, Any], theta: Any) -> None:
    """ValueError naming the first field whose JSON type is wrong (config.json is user input)."""
    for name, value in {**fields, **rope, "rope_theta": theta}.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in _INT_FIELDS and not (is_int and value > 0 or name.endswith("token_id") and is_int):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (name in _FLOAT_FIELDS or name == "rope_theta") and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if "layer_types" in fields and not all(isinstance(t, str) for t in fields["layer_types"]):
        raise ValueError("layer_types must be a list of strings")


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: the stop ids and sampling defaults the checkpoint ships."""

    eos_token_id: tuple[int, ...] = (200002, 199999, 200012)
    pad_token_id: int = 199999
    bos_token_id: int = 199998
    temperature: float | None = None
    top_p: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationConfig":
        eos = d.get("eos_token_id", cls.eos_token_id)
        eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            eos_token_id=eos,
            pad_token_id=int(d.get("pad_token_id", 199999)),
            bos_token_id=int(d.get("bos_token_id", 199998)),
            temperature=d.get("temperature"),
            top_p=d.get("top_p"),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "do_sample": True,
        }
        return d


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, turning every failure into a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found", "the checkpoint directory is incomplete; download it again")
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied", "make the file readable (chmod +r)")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})", "the file is corrupted; download it again")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object", "the file is corrupted; download it again")
    return data


def load_model_config(path: Path) -> ModelConfig:
    data = read_json(path)
    try:
        return ModelConfig.from_dict(data)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise CheckpointError(
            f"{path}: not a gpt-oss config ({e})",
            "point --model at a gpt-oss-20b or gpt-oss-120b checkpoint directory",
        )


def load_generation_config(path: Path) -> GenerationConfig:
    if not path.exists():
        return GenerationConfig()
    data = read_json(path)
    try:
        cfg = GenerationConfig.from_dict(data)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in cfg.eos_token_id):
            raise ValueError(f"eos_token_id must be token ids, got {data.get('eos_token_id')!r}")
        return cfg
    except (ValueError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{path}: invalid generation config ({e})", "download the checkpoint again")
