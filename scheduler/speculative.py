"""N-gram speculative decoding (prompt lookup), torch-free: the settings and the proposer.

A decoding completion whose last tokens also occur earlier in its own prompt or output (code being
edited, a document quoted, a list continued) often goes on as it went on there. The proposer finds
the latest earlier occurrence of its last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) and proposes the up to `num_speculative_tokens` tokens that followed it. The
scheduler feeds the completion's last token and the draft as one slice (`RequestSlice`), the model
computes logits at every position in the one forward, and the scheduler samples each position as an
ordinary decode step would (the same seed and step, the penalties over the draft tokens before it),
keeping tokens while each equals the draft token it verifies: the first that differs, or the one after
the whole draft, is still a true sample. So the tokens are the ones the completion would get without
speculation, whatever the temperature (the draft is a single proposal, which makes "sample, then
compare" the exact acceptance rule); a rejected draft token costs its forward position and nothing
else (its KV slot is freed at once).

Settings, vLLM's `--speculative-config` keys: {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verification step computes K + 1 positions: past a few, mostly wasted
MAX_LOOKUP = 16
# positions one call indexes at most (2-10 ms of Python on a loaded 2-core VM, lookup 2..4): the scheduler
# indexes a prompt along its prefill chunks, so a long one is never indexed in one step's stall (128K
# positions take ~0.3 s)
MAX_INDEX_PER_CALL = 2048
# proposals a completion sits out after drafts that kept nothing (but for matches of prompt_lookup_max
# tokens): none after one, then 1, 2, 4, and this many after each further miss in a row. Text that does not
# copy (most sampled replies) mostly matches a few tokens by chance, and then pays a draft position every
# ninth step, not every step; text that copies has its misses alone, and its long matches draft anyway.
MAX_REST = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no drafts while more completions than this decode together (a large batch's forward is compute
    # bound: a draft's extra positions cost there what they save at one stream); None: no limit
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The settings a `--speculative-config` JSON object gives; ValueError saying what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise ValueError(f"is not JSON ({err}); give an object such as "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        if not isinstance(raw, dict):
            raise ValueError('must be a JSON object, such as {"method": "ngram", "num_speculative_tokens": 3}')
        raw = dict(raw)
        method = raw.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"has method {method!r}: mlaserve proposes drafts by n-gram lookup only, give "
                             '"method": "ngram" (draft models, EAGLE and MTP heads are not supported)')
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"has unknown keys {unknown}; the ngram method takes {sorted(known)}")
        values: dict[str, Any] = {}
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if key in raw:
                values[key] = _whole(raw, key, 1, MAX_SPECULATIVE_TOKENS if key == "num_speculative_tokens"
                                     else MAX_LOOKUP)
        if raw.get("disable_by_batch_size") is not None:
            values["disable_by_batch_size"] = _whole(raw, "disable_by_batch_size", 1, 2**31 - 1)
        # one lookup bound given: the other's default, moved to it where the two would cross
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], cls.prompt_lookup_min)
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], cls.prompt_lookup_max)
        cfg = cls(**values)
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"has prompt_lookup_min {cfg.prompt_lookup_min} above prompt_lookup_max "
                             f"{cfg.prompt_lookup_max}")
        return cfg

    def describe(self) -> str:
        limit = "" if self.disable_by_batch_size is None else f", off above {self.disable_by_batch_size} streams"
        return (f"ngram, {self.num_speculative_tokens} draft tokens, lookup {self.prompt_lookup_min}.."
                f"{self.prompt_lookup_max}{limit}")


def _whole(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"has {key} {value!r}: it must be a whole number in {low}..{high}")
    return value


def speculative_json(value: str | None) -> str | None:
    """The `--speculative-config` flag's check (the problem, or None)."""
    if value is None:
        return None
    try:
        SpeculativeConfig.parse(value)
    except ValueError as err:
        return str(err)
    return None


class NgramProposer:
    """One completion's n-gram index: for each n, where each n-gram of its tokens last ended (among those
    followed by a token), extended as the completion grows, so a proposal costs a few dict lookups however
    long the context. Tokens never change once there (a retraction keeps them), so the index stays valid."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self._sizes = range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1)  # longest match first
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        self._indexed = 0  # n-grams ending before this position are in the index
        # the draft length this completion earns: a draft token costs a forward position whether kept or
        # not, so the length follows what its drafts keep (one more after a draft kept whole, one more than
        # was kept after one that was not): text that copies gets long drafts, text that does not, short ones
        self.length = cfg.num_speculative_tokens
        # a draft that keeps nothing costs its position for nothing, and in text that does not copy (most
        # sampled replies: 12-50% of draft tokens kept) most do: after two or more such drafts in a row the
        # completion sits out `_rest` proposals (doubling up to MAX_REST) but for its longest matches, and
        # the first token kept ends it
        self._misses = 0
        self._rest = 0

    def verified(self, drafted: int, kept: int) -> None:
        """How the last draft fared: `kept` of its `drafted` tokens were kept."""
        if not drafted:
            return
        self.length = min(self.cfg.num_speculative_tokens, self.length + 1 if kept == drafted else kept + 1)
        self._misses = 0 if kept else self._misses + 1
        self._rest = min(MAX_REST, 1 << (self._misses - 2)) if self._misses >= 2 else 0

    def index(self, ids: Callable[[int, int], Sequence[int]], upto: int) -> None:
        """Adds the n-grams ending at positions before `upto` (at most MAX_INDEX_PER_CALL more positions: one
        lagging behind proposes from the older text until it catches up)."""
        last = min(upto, self._indexed + MAX_INDEX_PER_CALL)
        if last <= self._indexed:
            return
        start = max(0, self._indexed - self.cfg.prompt_lookup_max + 1)
        tokens = ids(start, last)
        for end in range(self._indexed, last):
            at = end - start
            for n in self._sizes:
                if at + 1 >= n:
                    self._ends[n][tuple(tokens[at + 1 - n : at + 1])] = end
        self._indexed = last

    def propose(self, ids: Callable[[int, int], Sequence[int]], seq_len: int, k: int) -> list[int]:
        """`k` tokens to follow the sequence of `seq_len` tokens (`ids(start, end)` reads its slice): those after
        the latest earlier occurrence of its longest suffix found (repeated past the end with the period that
        occurrence implies), or none (also for a shorter suffix than prompt_lookup_max while the completion
        rests after drafts that kept nothing)."""
        if k <= 0 or seq_len < self.cfg.prompt_lookup_min + 1:
            return []
        self.index(ids, seq_len - 1)
        resting = self._rest > 0
        if resting:
            self._rest -= 1
        longest = self.cfg.prompt_lookup_max
        tail = ids(max(0, seq_len - longest), seq_len)
        for n in self._sizes:
            if n > len(tail):
                continue
            end = self._ends[n].get(tuple(tail[len(tail) - n :]))
            if end is not None:
                if resting and n < longest:  # a resting completion drafts on the longest matches alone: text
                    return []  # that starts copying again finds them at once
                draft = list(ids(end + 1, min(end + 1 + k, seq_len)))
                # a match close to the end: the tokens since repeat with that period (a loop goes on looping)
                period = seq_len - 1 - end
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


# drafts from a predicted output (OpenAI's `prediction`) start this long and adapt as n-gram drafts do, up to
# MAX_SPECULATIVE_TOKENS: a prediction is mostly the text itself, so long drafts pay
PREDICTION_TOKENS = 8
PREDICTION_LOOKUP = 4  # the longest tail of the output looked up in the prediction
PREDICTION_NEAR = 16  # a single-token match counts only this close past where the output left the prediction
PREDICTION_WINDOW = 4096  # prediction tokens past the cursor searched before the rest


class PredictionProposer:
    """Drafts for a completion whose output the client predicted (OpenAI's Predicted Outputs: a file being
    edited, sent back with a few changes): where the output has followed the prediction, the prediction's
    next tokens. The output's last tokens (up to PREDICTION_LOOKUP, longest first) are found in the prediction
    at or after the point it last followed (`cursor`), so after an edit the drafts pick the prediction up
    again where the output rejoins it; where nothing matches, `fallback` (the server's n-gram drafts, if any)
    proposes. Its drafts are verified as every draft is: the tokens are those the completion gets without.
    The prediction is searched as an array (a few vector compares a step, nearest window first), not
    indexed: a long one costs its request's steps nothing up front."""

    def __init__(self, prediction: Sequence[int], prompt_len: int, fallback: NgramProposer | None) -> None:
        import numpy as np  # (this module is imported where only the settings are wanted)

        self.pred = np.asarray(prediction, dtype=np.int64)
        self.prompt_len = prompt_len
        self.fallback = fallback
        self.length = PREDICTION_TOKENS
        self.cursor = 0  # the prediction's position the output is expected to go on from
        self.from_prediction = False  # whether the last draft came from the prediction
        self.missed_at: int | None = None  # the cursor of the last prediction draft whose first token was refused
        self.kept = self._rejected = 0  # the prediction's draft tokens the output kept, and those it did not

    @property
    def rejected(self) -> int:
        """The prediction's draft tokens not kept: at most the prediction's tokens not kept (OpenAI's bound)."""
        return min(self._rejected, len(self.pred) - self.kept)

    def verified(self, drafted: int, kept: int) -> None:
        if not self.from_prediction:
            if self.fallback is not None:
                self.fallback.verified(drafted, kept)
            return
        self.kept += kept
        self._rejected += drafted - kept
        self.missed_at = self.cursor if drafted and not kept else None
        if drafted:
            self.length = min(MAX_SPECULATIVE_TOKENS, self.length + 1 if kept == drafted else max(kept + 1, 2))

    def index(self, ids: Callable[[int, int], Sequence[int]], upto: int) -> None:
        if self.fallback is not None:
            self.fallback.index(ids, upto)

    def _find(self, key: Sequence[int], last: int) -> int | None:
        """Where the first occurrence of `key` ending at or after the cursor's token (and at most `last`) ends."""
        n, pred = len(key), self.pred
        lo, top = max(0, self.cursor - n), min(len(pred), last + 1) - n + 1
        for hi in (min(top, lo + PREDICTION_WINDOW), top):  # (the near window first: most matches are there)
            if lo >= hi:
                continue
            ok = pred[lo:hi] == key[0]
            for j in range(1, n):
                ok &= pred[lo + j : hi + j] == key[j]
            found = ok.nonzero()[0]
            if found.size:
                return lo + int(found[0]) + n - 1
            lo = hi
        return None

    def propose(self, ids: Callable[[int, int], Sequence[int]], seq_len: int, k: int) -> list[int]:
        self.from_prediction = False
        if k <= 0:
            return []
        tail = list(ids(max(self.prompt_len, seq_len - PREDICTION_LOOKUP), seq_len))  # the output's last tokens
        for n in range(len(tail), 0, -1):
            end = self._find(tail[len(tail) - n :], len(self.pred) if n > 1 else self.cursor + PREDICTION_NEAR)
            if end is not None:
                self.cursor = end + 1
                draft = self.pred[self.cursor : self.cursor + k].tolist()
                if draft and self.cursor != self.missed_at:  # (an output repeating a token would meet the
                    self.from_prediction = True  # same refused draft at every step)
                    return draft
                break
        if self.fallback is None:
            return []
        return self.fallback.propose(ids, seq_len, min(k, self.fallback.length))  # (its own length, as without)
