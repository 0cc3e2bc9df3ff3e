"""`TokenLogprob`: one sampled (or prompt) token's log-probability, as the sampler reports it.

Kept apart from the sampler (and free of torch) because it travels all the way up: the scheduler
stores it per request, the engine sends it to the server, the server renders OpenAI's `logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log_softmax of the model's logits (before any sampling transform)
    top: list[tuple[int, float]] = field(default_factory=list)  # top_logprobs alternatives, best first
