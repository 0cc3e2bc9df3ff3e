"""`ChoiceText` and `EngineRequest`: the text side of one engine request and of each choice it feeds.

Built by `serving`, read by the serializers in `responses`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator
from typing import NamedTuple

import msgspec

from engine.messages import FINISH_STOP, RequestOutput, TokenLogprob
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher


class ShownLogprob(NamedTuple):
    """A token's logprob, released once its text is sent; `offset`: where that text starts in the choice's
    generated text (for the completions API's `text_offset`), `end` where it ends (-1: where it starts)."""

    lp: TokenLogprob
    offset: int
    end: int = -1

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the token's text is in the span [start, end): it starts there, or runs into it."""
        return start <= self.offset < end or self.offset < start < self.end


class _Pending(NamedTuple):
    lp: TokenLogprob
    start: int  # the token's text in the detokenized stream, before stop strings: [start, end)
    end: int


@dataclasses.dataclass
class ChoiceText:
    """Text of one choice as it streams: detokenized, stop strings applied, held back while unsure.

    Logprobs go out with the text of their tokens, not ahead of it: a token is released once all of its
    text has been sent, and when a stop string cuts the text, the tokens that begin at or after the cut
    (the stop string's and any past it) are dropped with it, as llama.cpp's server does, so the logprobs
    describe the text the client gets."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    hidden_ids: frozenset[int] = frozenset()  # a final one is left out of the text (the request's stop ids, and EOS when special tokens show)
    stop_ids: frozenset[int] = frozenset()  # the request's stop_token_ids: one that ends the choice is its stop_reason
    min_tokens: int = 0  # no stop string may end in the text of the first min_tokens tokens (vLLM's rule)
    eos_ids: frozenset[int] = frozenset()  # ending on EOS leaves stop_reason null, as vLLM
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[ShownLogprob] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    predicted: tuple[int, int] = (0, 0)  # OpenAI's prediction: its draft tokens kept and not kept so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended the choice
    _produced: int = 0  # characters out of the detokenizer so far
    _sent: int = 0  # characters out of the stop-string matcher so far (the text the client has)
    _pending: collections.deque[_Pending] = dataclasses.field(default_factory=collections.deque)

    def feed(self, out: RequestOutput) -> tuple[str, list[int], list[ShownLogprob]]:
        """New text, ids and the logprobs released with this text (text may lag behind ids while held back)."""
        if self.finish_reason is not None:
            return "", [], []
        ids = out.new_token_ids
        if len(ids) > 1 and self.stops.has_stops:
            return self._feed_each(out)
        shown = len(ids)
        stopped_on = ids[-1] if out.finish_reason == FINISH_STOP and ids else None
        if stopped_on in self.hidden_ids:
            shown -= 1  # as vLLM: the id stays in token_ids and usage; its text is not shown
        # a stop or EOS id that ended the choice without text of its own gets no logprob either, as OpenAI's
        # (the logprobs describe the text: chat's `content` tokens join to the message)
        scored = len(ids) - (stopped_on is not None and stopped_on in self.eos_ids | self.stop_ids
                             and (stopped_on in self.hidden_ids or not self.detok.shows(stopped_on)))
        quiet = max(0, min(shown, self.min_tokens - len(self.token_ids)))  # ids before min_tokens: no stop string ends there
        lps = out.logprobs or []
        if lps:  # one id at a time: where each token's text starts and ends
            pieces = []
            for k, token in enumerate(ids):
                start = self._produced
                if k < shown:
                    pieces.append(self.detok.add((token,)))
                    self._produced += len(pieces[-1])
                if k < min(len(lps), scored):
                    self._pending.append(_Pending(lps[k], start, self._produced))
            early, late = "".join(pieces[:quiet]), "".join(pieces[quiet:])
        else:
            early, late = self.detok.add(ids[:quiet]), self.detok.add(ids[quiet:shown])
        armed = len(self.token_ids) + len(ids) > self.min_tokens  # a stop string may end in the text after `quiet`
        text, _ = self.stops.feed(early, armed=False)
        more, hit = self.stops.feed(late, armed=armed)
        text += more
        if not hit and out.finish_reason is not None:
            tail, hit = self.stops.feed(self.detok.flush(), armed=armed)
            text += tail if hit else tail + self.stops.flush()
        self._sent += len(text)
        self.token_ids += ids
        self.completion_tokens = out.completion_tokens
        self.predicted = (out.accepted_prediction_tokens, out.rejected_prediction_tokens)
        if hit:
            self.finish_reason, self.stop_reason = "stop", self.stops.matched
        elif out.finish_reason is not None:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            if stopped_on in self.stop_ids and stopped_on not in self.eos_ids:
                self.stop_reason = stopped_on
        released = self._release()
        self.logprobs += released
        return text, list(ids), released

    def _feed_each(self, out: RequestOutput) -> tuple[str, list[int], list[ShownLogprob]]:
        """Several tokens in one output (a speculative decoding step's) fed one at a time, so that a stop
        string ends the choice at the token that completes it: the ones after it are dropped from its
        token ids and usage too, as they would never have been generated one step at a time."""
        ids, n = out.new_token_ids, len(out.new_token_ids)
        text, fed, released = "", [], []
        for k, token in enumerate(ids):
            last = k == n - 1
            one = msgspec.structs.replace(out, new_token_ids=[token], logprobs=out.logprobs[k : k + 1] if out.logprobs
                                          else out.logprobs, finish_reason=out.finish_reason if last else None,
                                          completion_tokens=out.completion_tokens - (n - 1 - k))
            t, i, lps = self.feed(one)
            text, fed, released = text + t, fed + i, released + lps
            if self.finish_reason is not None:
                break
        return text, fed, released

    def _release(self) -> list[ShownLogprob]:
        pending, out, hit = self._pending, [], self.stops.stopped
        if self.finish_reason is None:
            # all its text sent; a token with no text of its own yet (the first bytes of a character)
            # waits until the text after it goes
            while pending and (pending[0].end < self._sent or pending[0].start < pending[0].end == self._sent):
                p = pending.popleft()
                out.append(ShownLogprob(p.lp, p.start, p.end))
        else:  # the end: what the text shows goes; after a stop string's cut, nothing past it
            out = [ShownLogprob(p.lp, p.start, p.end) for p in pending if not hit or p.start < self._sent]
            pending.clear()
        return out


@dataclasses.dataclass
class EngineRequest:
    """One engine request (one prompt) and the choices it feeds."""

    rid: str
    prompt_index: int
    prompt_ids: list[int]
    choices: list[ChoiceText]
    stream: AsyncIterator[RequestOutput]
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo + logprobs: one per prompt token

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)
