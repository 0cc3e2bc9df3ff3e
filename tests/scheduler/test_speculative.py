"""The n-gram proposer against a brute-force search, and `--speculative-config`'s parsing."""

from __future__ import annotations

import json
import random

import pytest

from scheduler.speculative import MAX_REST, NgramProposer, SpeculativeConfig, speculative_json


def brute_force(seq: list[int], cfg: SpeculativeConfig, k: int) -> list[int]:
    """The definition: the latest earlier occurrence of the longest suffix (n from max down to min) followed
    by a token; the tokens after it, repeated with period (last position - its end) while fewer than k."""
    if k <= 0:
        return []
    for n in range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1):
        if n >= len(seq):
            continue
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end - n + 1 : end + 1] == seq[len(seq) - n :]:
                draft = seq[end + 1 : end + 1 + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(seq) - 1 - end)])
                return draft
    return []


@pytest.mark.parametrize("seed", range(6))
def test_proposals_equal_the_brute_force_search(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    cfg = SpeculativeConfig(num_speculative_tokens=rng.randint(1, 6), prompt_lookup_min=lo,
                            prompt_lookup_max=lo + rng.randint(0, 3))
    vocab = rng.choice([2, 3, 5, 50])
    seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    proposer = NgramProposer(cfg)
    hits = 0
    for _ in range(150):
        k = rng.randint(0, cfg.num_speculative_tokens)
        got = proposer.propose(lambda a, b: seq[a:b], len(seq), k)
        assert got == brute_force(seq, cfg, k), (seq, k)
        hits += bool(got)
        # the completion grows by one token, or by several (a kept draft), sometimes by a loop's tokens
        more = rng.choice([1, 1, 2, 5])
        seq += got[:more] if got and rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(more)]
    assert hits > 10


def test_a_loop_is_continued_past_the_end():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=3))
    seq = [9, 1, 2, 3, 1, 2, 3, 1, 2]
    assert p.propose(lambda a, b: seq[a:b], len(seq), 5) == [3, 1, 2, 3, 1]
    seq += [3, 7, 7]
    assert p.propose(lambda a, b: seq[a:b], len(seq), 3) == [7, 7, 7]
    assert p.propose(lambda a, b: seq[a:b], len(seq), 0) == []
    assert NgramProposer(SpeculativeConfig()).propose(lambda a, b: [4, 5, 6][a:b], 3, 3) == []


def test_drafts_that_keep_nothing_rest_the_completion():
    """After drafts that kept nothing in a row, the completion sits out 0 (one miss alone: text that copies
    has those), 1, 2, 4, then MAX_REST proposals of matches shorter than prompt_lookup_max (a draft there
    would have been found); a match of prompt_lookup_max tokens drafts all the same, and a kept token ends
    the rest at once."""
    seq = [9, 1, 2, 3, 4, 7, 8, 5, 1, 2]  # its suffix [1, 2] occurred before, [5, 1, 2] did not
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3))  # lookup 2..4

    def draft() -> list[int]:
        return p.propose(lambda a, b: seq[a:b], len(seq), 3)

    def rests_after_a_miss() -> int:
        p.verified(1, 0)
        n = 0
        while not draft():
            n += 1
            assert n <= MAX_REST
        return n

    assert draft() == [3, 4, 7]
    assert [rests_after_a_miss() for _ in range(7)] == [0, 1, 2, 4, MAX_REST, MAX_REST, MAX_REST]
    p.verified(1, 0)
    assert draft() == []
    seq += [3, 4]  # [1, 2, 3, 4]: a match of prompt_lookup_max tokens drafts while resting
    assert draft() == [7, 8, 5]
    p.verified(3, 3)  # tokens kept: drafts come back at once, however long the run of misses was
    seq += [7, 8, 5, 6, 1, 2]  # [6, 1, 2] did not occur: [1, 2] matches, shorter
    assert draft() == [3, 4, 7]
    assert [rests_after_a_miss() for _ in range(2)] == [0, 1]
    p.verified(0, 0)  # no draft: nothing learnt
    assert draft()


def test_config_parsing():
    parse = SpeculativeConfig.parse
    assert parse('{"method": "ngram"}') == SpeculativeConfig()
    assert parse(json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6,
                             "prompt_lookup_min": 3, "disable_by_batch_size": 8})) == \
        SpeculativeConfig(5, 6, 3, 8)
    assert parse('{"method": "ngram", "prompt_lookup_max": 1}') == SpeculativeConfig(prompt_lookup_max=1,
                                                                                      prompt_lookup_min=1)
    assert parse('{"method": "ngram", "prompt_lookup_min": 7}') == SpeculativeConfig(prompt_lookup_max=7,
                                                                                      prompt_lookup_min=7)
    assert parse('{"method": "ngram", "disable_by_batch_size": null}').disable_by_batch_size is None
    for text, words in [
        ("ngram", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"num_speculative_tokens": 3}', "method None"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "n-gram lookup only"),
        ('{"method": "ngram", "model": "x"}', "unknown keys ['model']"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens 0"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "1..16"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "whole number"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "whole number"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "above prompt_lookup_max"),
        ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size 0"),
    ]:
        with pytest.raises(ValueError, match=None) as err:
            parse(text)
        assert words in str(err.value), (text, str(err.value))
        assert speculative_json(text) == str(err.value)
    assert speculative_json(None) is None and speculative_json('{"method": "ngram"}') is None


def test_the_draft_length_follows_what_the_drafts_keep():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    assert p.length == 4
    p.verified(4, 1)  # one kept: two next
    assert p.length == 2
    p.verified(2, 0)
    assert p.length == 1
    p.verified(1, 1)  # kept whole: one more each time, up to the setting
    p.verified(2, 2)
    p.verified(3, 3)
    p.verified(4, 4)
    assert p.length == 4
    p.verified(0, 0)  # no draft: nothing learnt
    assert p.length == 4


def test_a_long_prompt_is_indexed_along_its_chunks_not_in_one_call():
    """One call indexes at most MAX_INDEX_PER_CALL positions (a 128K prompt at once stalled a step ~0.3 s):
    the scheduler indexes the prompt chunk by chunk as it is prefilled; a proposer left behind proposes from
    the older text until it catches up."""
    from scheduler.speculative import MAX_INDEX_PER_CALL

    rng = random.Random(3)
    n = 4 * MAX_INDEX_PER_CALL + 100
    seq = [rng.randrange(10**6) for _ in range(n)]
    seq[n - 1000 : n - 997] = seq[n - 3 :]  # the suffix's one earlier occurrence, near the end
    cfg = SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3)
    ids = lambda a, b: seq[a:b]  # noqa: E731
    want = brute_force(seq, cfg, 3)
    assert want == seq[n - 997 : n - 994]
    chunked = NgramProposer(cfg)
    for upto in range(512, n, 512):
        chunked.index(ids, min(upto, n - 1))
    assert chunked.propose(ids, n, 3) == want
    behind = NgramProposer(cfg)
    got = [behind.propose(ids, n, 3) for _ in range(5)]
    assert got[0] == [] and got[-1] == want


def prediction_brute_force(pred: list[int], out: list[int], cursor: int, k: int) -> tuple[list[int], int]:
    """PredictionProposer's definition: the output's last n tokens (n from 4 down to 1), the first occurrence in
    the prediction ending at or past cursor - 1 (a single token at most 16 past the cursor); the k tokens after
    it, and the new cursor. ([], cursor) when nothing matches."""
    for n in range(min(4, len(out)), 0, -1):
        key = out[len(out) - n :]
        for end in range(max(cursor - 1, n - 1), len(pred)):
            if n == 1 and end > cursor + 16:
                break
            if pred[end - n + 1 : end + 1] == key:
                return (pred[end + 1 : end + 1 + k], end + 1) if end + 1 < len(pred) else ([], end + 1)
    return [], cursor


@pytest.mark.parametrize("seed", range(4))
def test_prediction_drafts_equal_the_brute_force_search(seed):
    """A completion that follows a prediction with edits (tokens changed, dropped, added): each draft is the
    brute-force one, across windows of the search (a prediction longer than PREDICTION_WINDOW)."""
    from scheduler.speculative import PREDICTION_WINDOW, PredictionProposer

    rng = random.Random(seed)
    pred = [rng.randrange(40) for _ in range(PREDICTION_WINDOW + 600)]
    out: list[int] = []
    i = 0
    while i < len(pred) and len(out) < 3000:  # the output: the prediction, edited here and there
        x = rng.random()
        if x < 0.03:
            out += [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
        elif x < 0.05:
            i += rng.randrange(1, 30)
        else:
            out.append(pred[i])
            i += 1
    prompt = [99] * 5
    p = PredictionProposer(pred, len(prompt), None)
    seq = prompt + out
    cursor = 0
    for t in range(1, len(out), rng.randrange(1, 4)):
        want, cursor_after = prediction_brute_force(pred, out[:t], cursor, 8)
        got = p.propose(lambda a, b: seq[a:b], len(prompt) + t, 8)
        assert got == want and p.from_prediction == bool(want) and p.cursor == cursor_after, t
        cursor = cursor_after


def test_a_refused_prediction_draft_is_not_proposed_again_in_place():
    """An output repeating one token meets a one-token match before the same refused draft at every step:
    it is proposed once (rejected tokens stay within the prediction's); where the prediction has nothing, the
    n-gram drafts behind it propose at their own length, not the prediction's."""
    from scheduler.speculative import PredictionProposer

    t, x = 5, 9
    p = PredictionProposer([t, x], 2, None)
    seq = [1, 2] + [t] * 20
    assert p.propose(lambda a, b: seq[a:b], 3, 8) == [x]
    p.verified(1, 0)
    for n in range(4, 22):
        assert p.propose(lambda a, b: seq[a:b], n, 8) == [], n
    assert (p.kept, p.rejected) == (0, 1)
    ngram = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    p = PredictionProposer([7, 7, 7], 2, ngram)
    loop = [1, 2, 3, 4, 3, 4, 3, 4, 3]
    assert p.propose(lambda a, b: loop[a:b], len(loop), 8) == [4, 3] and not p.from_prediction
