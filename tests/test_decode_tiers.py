"""The decode graphs' context tiers (runner.decode_tiers, Runner.graph_key): which attention split
counts get a graph, and which graph a batch replays."""

from types import SimpleNamespace

from gptoss_cli.runtime.gpu.runner import CONTEXT_MARGIN, SHORT_CONTEXT, Runner, decode_tiers

H200_SMS = 132


def test_batch_one_gets_a_one_split_graph_below_the_long_one():
    tiers = decode_tiers(1, 8, 128, 131072, H200_SMS, short=True)
    assert tiers == [(SHORT_CONTEXT, (1, 1)), (131072, (66, 1))]


def test_no_short_tier_when_off_when_it_would_repeat_or_when_contexts_are_short():
    assert decode_tiers(1, 8, 128, 131072, H200_SMS, short=False) == [(131072, (66, 1))]
    assert decode_tiers(128, 8, 128, 131072, H200_SMS, short=True) == [(131072, (1, 1))]  # one split anyway
    assert decode_tiers(1, 8, 128, SHORT_CONTEXT, H200_SMS, short=True) == [(SHORT_CONTEXT, (1, 1))]


def _key(contexts, buckets=(1, 2, 4)):
    runner = SimpleNamespace(buckets=buckets,
                             _tiers={b: decode_tiers(b, 8, 128, 131072, H200_SMS, True) for b in buckets})
    return Runner.graph_key(runner, [SimpleNamespace(num_computed=c) for c in contexts])


def test_graph_key_takes_the_smallest_bucket_and_the_tier_of_the_longest_row():
    limit = SHORT_CONTEXT - CONTEXT_MARGIN
    assert _key([limit]) == (1, (1, 1))
    assert _key([limit + 1]) == (1, (66, 1))
    assert _key([5, 7, limit]) == (4, (1, 1))
    assert _key([5, limit + 1, 7]) == (4, (17, 1))
