"""`SamplingParams`: how one request's tokens are chosen and when it stops; `ParamError`: a bad one.

Validated once, at the server edge, where the vocabulary size is known: `validate` raises
`ParamError(param, message)` naming the offending OpenAI parameter, and the server turns it into a
400 whose `param` is `ParamError.param` (never parsed back out of the message). `validate_prompt_ids`
is the same check for the prompt's token ids (`validate_token_ids` for any ids: `/detokenize`'s). The
engine runs neither as a validation of its own (see `engine.core`): what reaches it was checked here.

`SamplingParams` is a frozen msgspec Struct: it crosses the server -> engine pipe inside
`engine.messages.GenerateRequest`, typed, and a field the decoder does not know is an error.
Copy with changes: `msgspec.structs.replace(params, max_tokens=8)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

# Sentinel for "no limit" on top_k, as in vLLM/SGLang.
TOP_K_ALL = -1
# the most alternatives a token's logprobs list (vLLM's default max_logprobs, which harnesses written for it ask for;
# OpenAI's chat limit too, its completions' is 5)
MAX_TOP_LOGPROBS = 20
INT64_MAX = 2**63 - 1  # the largest integer the engine messages carry signed
# temperatures below this are greedy (vLLM's _SAMPLING_EPS)
GREEDY_BELOW = 1e-5


class ParamError(ValueError):
    """A request parameter the server refuses: `param` is its OpenAI name ("top_p", "logit_bias",
    "stop_token_ids", "prompt", ...), `message` the text for the client (it names the parameter too)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on the completion's text, compiled by the engine's grammar backend into a token mask.

    `kind` says how to read `spec`: "json_schema" (a JSON Schema as JSON text), "json_object" (any JSON
    object; `spec` is empty), "regex", "grammar" (EBNF in GBNF's syntax, root rule `root`), or
    "structural_tag" (xgrammar's structural tag as JSON text: free text in which each trigger begins a
    tag whose content is constrained, as tool calls under tool_choice "auto" with strict tools). `param`
    is the request parameter it came from ("response_format", "tool_choice", ...): a spec the engine
    cannot compile is refused with a 400 naming it."""

    kind: str
    spec: str = ""
    param: str = "response_format"
    # a reasoning model's end of thought (the ids of `</think>`): the constraint applies to what follows
    # them, the reasoning before them is free; empty: from the first token
    after: tuple[int, ...] = ()

    @property
    def free(self) -> bool:
        """The text may end anywhere but inside a tag (a structural tag): min_tokens still holds off its
        end, where a document's grammar alone decides where it may end."""
        return self.kind == "structural_tag"


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, [0, 1] (0: the best token alone)
    top_k: int = TOP_K_ALL  # keep the k most likely; -1 = all
    min_p: float = 0.0  # drop tokens below min_p * p(max), [0, 1]
    repetition_penalty: float = 1.0  # HF/CTRL style: logits of seen tokens divided (>0) or multiplied (<0)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence among generated tokens
    logit_bias: dict[int, float] = {}  # token id -> bias added to the logit (msgspec copies the default)
    seed: int | None = None  # same seed + same prompt => same tokens, whatever shares the batch
    n: int = 1  # completions sharing the prompt's KV
    max_tokens: int | None = None  # None: until the context is full
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens exist
    # Generation ends ("stop") right after one of these ids is sampled. The id is part of the
    # completion's token ids and usage; the server leaves its text out (as vLLM does by default).
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's: only these ids may be generated (empty: any); and these id sequences never complete (a
    # sequence's last id is masked right after its others, a one-id sequence always)
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # and this many alternatives
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens too (+ this many alternatives); None = off
    structured: StructuredOutput | None = None  # constrained decoding: only tokens the grammar allows
    # not sampling but how the tokens are computed: decode with OmniKV's sparse attention (True), with
    # full attention (False), or as the server's --omnikv decides (None)
    omnikv: bool | None = None
    # vLLM's: the prefix cache shares this request's KV only with requests that bring the same salt
    cache_salt: str | None = None
    # vLLM's: with the priority scheduling policy, lower values are admitted first (and retracted last)
    priority: int = 0
    # OpenAI's predicted output, tokenized: drafts for speculative decoding (the tokens stay the model's)
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or below GREEDY_BELOW (as vLLM's 1e-5: logits / 1e-6 would tell apart
        logits 1e-6 apart with noise of unit size, a draw in name only). Not top_k 1: that keeps every
        token tied with the best (as HF and vLLM do), which argmax, taking the lowest id, did not."""
        return self.temperature < GREEDY_BELOW

    def validate(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """Raises ParamError naming the OpenAI parameter when a value is out of range, or when the token
        constraints leave nothing to generate (with the model's `eos_token_ids`, which min_tokens masks)."""
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", "temperature must be between 0 and 100")
        _check(0.0 <= self.top_p <= 1.0, "top_p", "top_p must be in [0, 1]")  # 0: the best token alone (OpenAI takes 0)
        _check(self.top_k == TOP_K_ALL or 1 <= self.top_k <= INT64_MAX, "top_k",
               "top_k must be -1 or 0 (all) or between 1 and 2^63 - 1 (any value from the vocabulary size up keeps "
               "all)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        _check(math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", "repetition_penalty must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        for tok, bias in self.logit_bias.items():
            _check(0 <= tok < vocab_size, "logit_bias",
                   f"logit_bias has token id {tok} outside the vocabulary (0..{vocab_size - 1})")
            _check(-100.0 <= bias <= 100.0, "logit_bias", "logit_bias values must be in [-100, 100]")
        _check(1 <= self.n <= 128, "n", "n must be in [1, 128]")
        _check(self.max_tokens is None or self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
               "max_tokens", "max_tokens must be >= 1 (0 only with echo on the completions API: the prompt alone is scored or echoed)")
        _check(self.max_tokens is None or self.max_tokens <= INT64_MAX, "max_tokens", "max_tokens must be below 2^63")
        _check(0 <= self.min_tokens <= INT64_MAX, "min_tokens", "min_tokens must be between 0 and 2^63 - 1")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}; where the request sets "
               "none, the tokens its context has room for)")
        for tok in self.stop_token_ids:
            _check(0 <= tok < vocab_size, "stop_token_ids",
                   f"stop_token_ids has token id {tok} outside the vocabulary (0..{vocab_size - 1})")
        validate_token_ids(self.allowed_token_ids, vocab_size, "allowed_token_ids")
        validate_token_ids(self.prediction, vocab_size, "prediction", "predicted token id")
        for word in self.bad_words_ids:
            _check(len(word) > 0, "bad_words", "a bad word has no tokens")
            validate_token_ids(word, vocab_size, "bad_words")
        top = MAX_TOP_LOGPROBS
        _check(0 <= self.top_logprobs <= top, "top_logprobs", f"top_logprobs must be in [0, {top}]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= top, "logprobs", f"logprobs must be in [0, {top}]")
        _check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "seed must fit in 64 bits")
        if self.allowed_token_ids:  # only what is knowable now; the sampler ends a completion left with no choice later
            banned = {w[0] for w in self.bad_words_ids if len(w) == 1}
            possible = set(self.allowed_token_ids) - banned
            _check(bool(possible), "bad_words", "bad_words bans every id of allowed_token_ids: nothing could be generated")
            if self.min_tokens > 0 and (self.structured is None or self.structured.free):  # (else the grammar decides)
                _check(bool(possible - set(eos_token_ids) - set(self.stop_token_ids)), "min_tokens",
                       f"min_tokens {self.min_tokens} needs tokens that do not end the completion, and "
                       "allowed_token_ids leaves only end-of-sequence or stop_token_ids ids")
        if self.structured is not None:
            _check(self.structured.kind in STRUCTURED_KINDS, self.structured.param,
                   f"unknown structured output kind {self.structured.kind!r} (one of {', '.join(STRUCTURED_KINDS)})")
            _check(all(0 <= t < vocab_size for t in self.structured.after), self.structured.param,
                   "the reasoning marker's token ids must be in the vocabulary")


def validate_prompt_ids(input_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Raises ParamError(param, ...) for an empty prompt or a token id outside the vocabulary."""
    _check(len(input_ids) > 0, param, "the prompt is empty")
    validate_token_ids(input_ids, vocab_size, param, "prompt token id")


def validate_token_ids(ids: Sequence[int], vocab_size: int, param: str, what: str = "token id") -> None:
    """Raises ParamError(param, ...) for the first id outside the vocabulary (0..vocab_size-1)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    _check(bad is None, param, f"{what} {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
