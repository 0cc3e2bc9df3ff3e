"""`Req`: one completion being generated (a request with n > 1 becomes n of them), and its KV state.

KV ownership of a running Req (the source of every leak, so stated once here):
  req_to_token[row, 0 : cache_len]       slots owned by the prefix cache, locked through `node`
  req_to_token[row, cache_len : kv_len]  slots this Req owns and must free or hand to the cache
Tokens all_ids[kv_len:] have no KV yet; the next forward feeds them (one token when decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from executor.logprobs import TokenLogprob
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server side reads FINISH_* here and must not load torch through the grammar module
    from executor.grammar import DraftMask, Grammar
    from scheduler.speculative import NgramProposer, PredictionProposer

# finish_reason values the scheduler decides (the engine adds "error": engine.messages.FINISH_ERROR)
FINISH_STOP = "stop"  # EOS or a stop token id (or a stop string found by the server)
FINISH_LENGTH = "length"  # max_tokens reached or the context is full
FINISH_ABORT = "abort"  # aborted by the client (disconnect) or by the server


@dataclass(eq=False)
class Req:
    rid: str
    index: int  # completion index within its request (n > 1)
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    # KV state (see the module docstring)
    row: int | None = None
    kv_len: int = 0
    cache_len: int = 0
    node: object = None
    # where the KV written by OmniKV's sparse decode steps begins (None: all of it from full attention): a
    # full-attention forward would not reproduce those rows, so the prefix cache takes none of them
    sparse_kv_from: int | None = None
    grammar: Grammar | None = None  # structured output: the completion's matcher (its own, even for n > 1)
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache at first admission
    waits_for_sibling: bool = False  # n > 1: siblings wait until completion 0 has prefilled the prompt
    # speculative decoding (scheduler.speculative): the completion's n-gram index, made at its first draft,
    # and the draft tokens this step verifies after its last token (empty: a plain decode step)
    proposer: NgramProposer | PredictionProposer | None = None
    draft: list[int] = field(default_factory=list)
    draft_masks: list[DraftMask] = field(default_factory=list)  # under a grammar: each draft position's mask
    # what the next RequestOutput carries
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # being filled while the prompt is prefilled
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int | None = None) -> list[int]:
        """all_ids[start:end] without joining the whole sequence first: a decode step takes one token from
        the end, and joining would touch every token object of a long prompt (cold, each step)."""
        n = len(self.prompt_ids)
        end = n + len(self.output_ids) if end is None else end
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens without KV yet."""
        return self.seq_len - self.kv_len

    @property
    def scores_prompt(self) -> bool:
        """Still prefilling a prompt whose token logprobs were asked for (each position's logits needed)."""
        if self.params.prompt_logprobs is None:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def is_decoding(self) -> bool:
        return self.row is not None and self.num_pending == 1 and self.kv_len > 0
