"""From the --model argument to a loaded engine and tokenizer, with progress on stderr.

Accepted: `20b` / `120b` (openai/gpt-oss-* already downloaded), a Hugging Face repo id that was
downloaded, a checkpoint directory, or `random:tiny|20b|120b`. Default: $GPTOSS_MODEL, else 20b.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import ModelSpecError
from .console import Ui

DEFAULT_MODEL = "20b"
ALIASES = {"20b": "openai/gpt-oss-20b", "120b": "openai/gpt-oss-120b"}


@dataclass
class LoadedModel:
    name: str  # what the user asked for, for display and records
    engine: object  # runtime.api.Engine
    tokenizer: object  # runtime.tokenizer.Tokenizer
    load_seconds: float


def model_display_name(spec: str) -> str:
    if spec in ALIASES:
        return f"gpt-oss-{spec}"
    return spec if spec.startswith("random:") else Path(spec).name or spec


def resolve_model(spec: str | None) -> str:
    """The spec the runtime understands: a directory path or random:NAME."""
    spec = spec or os.environ.get("GPTOSS_MODEL") or DEFAULT_MODEL
    if spec.startswith("random:"):
        return spec
    path = Path(spec).expanduser()
    if path.exists():
        return str(path)
    if spec in ALIASES or (spec.count("/") == 1 and not spec.startswith((".", "/", "~"))):
        from ..hub import find_local_model

        local = find_local_model(spec)
        if local is None:
            raise ModelSpecError(f"model {spec} is not downloaded",
                                 f"run `gptoss download {spec}` first, or try `--model random:tiny` (no weights needed)")
        return str(local)
    raise ModelSpecError(f"{spec}: no such model or directory",
                         "pass 20b, 120b, a checkpoint directory, or random:tiny|random:20b|random:120b")


def load_model(ui: Ui, spec: str | None, **engine_options) -> LoadedModel:
    """Resolve, load weights, build the engine; shows what is happening on stderr."""
    from ..runtime.loading import create_engine, default_device, load_tokenizer, load_weights

    resolved = resolve_model(spec)
    name = model_display_name(spec or os.environ.get("GPTOSS_MODEL") or DEFAULT_MODEL)
    device = default_device()
    start = time.perf_counter()
    with _status(ui, f"loading {name} on {device}") as status:
        weights = load_weights(resolved, device=device)
        tokenizer = load_tokenizer(weights)
        engine = create_engine(weights, progress=_warmup_reporter(ui, status), **engine_options)
    seconds = time.perf_counter() - start
    if device == "cpu":
        ui.note(f"no CUDA GPU found: running {name} on the CPU reference path (slow for real checkpoints)")
    ui.note(f"loaded {name} in {seconds:.1f}s")
    return LoadedModel(name, engine, tokenizer, seconds)


def _status(ui: Ui, message: str):
    """A spinner on a terminal, one plain line otherwise."""
    if ui.interactive:
        return ui.err.status(message)
    ui.note(message + " …")
    from contextlib import nullcontext

    return nullcontext()


def _warmup_reporter(ui: Ui, status):
    """progress(stage, done, total) for engine warm-up: the spinner's text on a terminal, a line
    per stage (and at the end) otherwise."""
    def report(stage: str, done: int, total: int) -> None:
        if status is not None:
            status.update(f"{stage} {done}/{total}")
        elif done in (1, total):
            ui.note(f"{stage} {done}/{total}")
    return report
