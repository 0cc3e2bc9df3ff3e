"""`TokenLogprob`: one sampled (or prompt) token's log-probability, as the sampler reports it.

Kept apart from the sampler (and free of torch) because it travels all the way up: the scheduler
stores it per request, the engine sends it to the server (a msgspec Struct inside
`engine.messages.RequestOutput`, typed on the pipe), the server renders OpenAI's `logprobs`.
"""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token_id: int
    logprob: float  # log_softmax of the model's logits (before any sampling transform); may be -inf
    top: list[tuple[int, float]] = []  # top_logprobs alternatives, best first (msgspec copies the default)
    rank: int | None = None  # a prompt token's: how many tokens the model rates at least as likely (vLLM's rank)
