"""Stop sequences (runtime/stop_strings.py): the matcher on text in pieces, the filter on harmony
events, the per-token watch; `gptoss run` and `gptoss chat` use them (tests in test_run.py and
test_chat.py)."""

from __future__ import annotations

import random

import pytest

from gptoss_cli.runtime.harmony_parse import MessageEnd, MessageStart, TextDelta
from gptoss_cli.runtime.harmony_types import Message
from gptoss_cli.runtime.stop_strings import StopFilter, StopMatcher, StopWatch, check_stops, cut_at_stop


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("seed", range(200))
def test_matcher_in_pieces_equals_cutting_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in _pieces(text, rng))
    if not matcher.hit:
        out += matcher.flush()
    assert (out, matcher.hit) == cut_at_stop(text, stops)


def test_matcher_holds_back_only_what_could_start_a_stop_string():
    m = StopMatcher(["END", "!"])
    assert m.push("hello E") == "hello "  # "E" could be the start of END
    assert m.push("N") == ""  # "EN" still could
    assert m.push("x") == "ENx"  # "ENx" cannot
    assert m.push("E") == ""
    assert m.flush() == "E"


def test_matcher_the_first_completed_stop_wins_and_nothing_follows_a_hit():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world, again") == "hel"
    assert m.hit
    assert m.push("more") == "" and m.flush() == ""
    # "b" is complete before "abc" would be, though "abc" starts earlier (generation stops there).
    assert cut_at_stop("xabc", ["abc", "b"]) == ("xa", True)
    assert cut_at_stop("xabc", ["bc", "abc"]) == ("x", True)  # both end at c: the longer one is cut


@pytest.mark.parametrize("bad", [[""], ["a", 1], ["a", "b", "c", "d", "e"], [None]])
def test_check_stops_rejects(bad):
    with pytest.raises(ValueError):
        check_stops(bad)


def _message(channel, text, recipient=None):
    start = MessageStart("assistant", channel, recipient, None)
    return [start, *(TextDelta(channel, t, recipient) for t in text),
            MessageEnd(Message("assistant", "".join(text), channel=channel, recipient=recipient), 200007)]


def _texts(events, channel):
    return "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel == channel)


def test_filter_cuts_the_answer_but_never_the_reasoning_or_tool_calls():
    f = StopFilter(["STOP"])
    events = (_message("analysis", ["I will say ST", "OP here"]) + _message("commentary", ['{"a": "STOP"}'], "functions.x")
              + _message("final", ["The answer is S", "TO", "P and more"]) + _message("final", ["never"]))
    out = f.feed(events)
    assert _texts(out, "analysis") == "I will say STOP here"
    assert _texts(out, "commentary") == '{"a": "STOP"}'
    assert _texts(out, "final") == "The answer is "
    assert f.stopped and f.message == Message("assistant", "The answer is ", channel="final")
    assert out[-1] == MessageEnd(f.message, None)
    assert f.feed(_message("final", ["after"])) == []


def test_filter_releases_held_back_text_before_the_message_ends():
    f = StopFilter(["STOP"])
    out = f.feed(_message("final", ["ends with ST"]))
    assert _texts(out, "final") == "ends with ST" and isinstance(out[-1], MessageEnd)
    assert [type(e) for e in out] == [MessageStart, TextDelta, TextDelta, MessageEnd]
    assert not f.stopped and f.message is None


def test_filter_without_stops_passes_everything():
    events = _message("final", ["a", "b"])
    assert StopFilter([]).feed(events) == events


@pytest.fixture(scope="module")
def tokenizer():
    from gptoss_cli.runtime.tokenizer import Tokenizer, load_o200k_base_ranks

    return Tokenizer.from_ranks(load_o200k_base_ranks())


def test_watch_on_tokens(tokenizer):
    from gptoss_cli.runtime.tokenizer import CHANNEL, MESSAGE, RETURN

    tok = tokenizer
    text = tok.encode("one two three")
    prefix = [CHANNEL, *tok.encode("final"), MESSAGE]
    # The answer reaches " two" with the first token whose text completes it.
    first = next(i for i in range(len(text)) if " two" in tok.decode(text[:i + 1]))
    watch = StopWatch(tok, [" two"])
    hits = [watch.feed(t) for t in [*prefix, *text, RETURN]]
    assert hits.index(True) == len(prefix) + first and all(hits[len(prefix) + first:])
    # Reasoning never stops the reply.
    analysis = StopWatch(tok, [" two"])
    assert not any(analysis.feed(t) for t in [CHANNEL, *tok.encode("analysis"), MESSAGE, *text])
    raw = StopWatch(tok, ["two"], harmony=False)
    assert [raw.feed(t) for t in tok.encode("one two")][-1] and not StopWatch(tok, ["x"], harmony=False).feed(RETURN)
    # Raw text counts special tokens by name, as the record's decoded text does.
    special = StopWatch(tok, ["a<|end"], harmony=False)
    assert [special.feed(t) for t in [*tok.encode("a"), tok.encode_special("<|end|>")]] == [False, True]
