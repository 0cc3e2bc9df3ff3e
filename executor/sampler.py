"""Batched sampling: one call per engine step turns the last-position logits of every request that
needs a token into that token (and its logprobs, when asked).

Per row, in this order (HF transformers' and SGLang's; vLLM's V1 engine applies min_p before top_k and top_p):

    raw logits [B, V] ──► grammar mask (constrained rows) ──► logit_bias, allowed ids, bad words ──► repetition / frequency / presence penalties ──► min_tokens mask
        ├─ greedy (temperature below 1e-5) ──► argmax
        └─ / temperature ──► top_k ──► top_p ──► min_p ──► argmax(x + Gumbel noise)
    raw logits (grammar-masked) ──► log_softmax ──► chosen token's logprob + top_logprobs alternatives

Columns >= `vocab_size` (padding of the LM head) are cut off first, so they are never sampled. A row
that the processors leave with no finite logit (allowed ids a bad word or the grammar forbids now) is
reported in `SampleResult.no_choice`: the scheduler ends that completion rather than emit a token.

Reproducibility (docs/architecture.md §4): sampling is Gumbel-max with *counter-based* noise. Token id j
of row r gets the uniform `counter_uniforms`(noise_seed(seed_r, step_r), j): SplitMix64's finalizer of the
row's key plus (j + 1) times the golden increment, an odd multiple of 2^-53 (never 0 or 1), whose noise
-log(-log(u)) is added in float64 to the row's fp32 logits / temperature. So a seeded request's token
depends only on (seed, step, its own logits), never on which other rows share the batch or in what
order, nor on the device (the same integer arithmetic in C++ and in torch ops on any device), and a row
with few candidates draws noise for those alone.
The engine must give each of a request's `n` completions its own seed, or they come out identical.

Vectorized across the batch: bias, penalties and the min_tokens mask each touch only the listed ids
(one gather/scatter for the whole batch). On the CPU the draw itself (temperature, top_k, top_p, min_p,
noise, best score) is one native call for the batch's sampled rows (`cpp_experts.sample_rows`: ~30 us a
row at the default model's own defaults on its 49152 columns, ~18x the torch code before it); the torch
code below is its definition, and draws on other devices and the rows the native call leaves (a NaN or
an infinite logit). There, rows with a top_k share one partial sort (`topk`), rows with only a top_p another,
as wide as their mass needs (`_best_holding`), and such rows draw among those sorted candidates alone
(min_p, their noise, the best score), which picks what the whole row's argmax picks (ties to the
smallest id). Equal logits are in id order wherever the order counts (top_p's running mass). Penalties
rebuild their id lists from prompt + output every step, which is O(context) Python work per penalized row.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

import cpp_experts
from executor.grammar import DraftMask, Grammar, apply_grammar_masks
from executor.logprobs import TokenLogprob

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, SplitMix64's increment
# Temperatures below this are raised to it (logits / 1e-5 stay finite in fp32); SamplingParams.greedy
# already takes such rows as greedy, so only another SamplingKnobs could send one.
_MIN_TEMPERATURE = 1e-5
# Rows with a top_k or top_p draw among their candidates alone (`Sampler._draw`); off: every row whole,
# the definition (tests and bench/sampler_cpu.py compare the two)
_CANDIDATES = True
# Sampled rows on the CPU are drawn natively (`cpp_experts.sample_rows`); off: by the torch code alone
_NATIVE = True


class SamplingKnobs(Protocol):
    """What the sampler reads of a request's sampling parameters (`scheduler.sampling_params.SamplingParams`
    is the one implementation; the executor does not import the scheduler above it)."""

    @property
    def greedy(self) -> bool: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> dict[int, float]: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def allowed_token_ids(self) -> tuple[int, ...]: ...
    @property
    def bad_words_ids(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def top_logprobs(self) -> int: ...


@dataclass
class SamplingRow:
    """One request that needs its next token this step."""

    params: SamplingKnobs
    seed: int  # the request's seed (the engine assigns one when params.seed is None)
    step: int  # index of the token being sampled within this completion (0 for the first)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated so far in this completion
    eos_token_ids: Sequence[int]  # model EOS ids, masked (with stop_token_ids) until min_tokens exist
    # constrained decoding: only the ids it allows next can be chosen (a draft position's: what it allowed there)
    grammar: Grammar | DraftMask | None = None


@dataclass
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row: None unless params.logprobs or top_logprobs > 0
    # rows whose constraints (allowed ids, bad words, min_tokens, grammar) left no token at all: their
    # token_ids entry is meaningless and the completion must end here
    no_choice: tuple[int, ...] = ()


def noise_seed(seed: int, step: int) -> int:
    """The generator seed for (seed, step): output number `step` of SplitMix64 seeded with `seed`.

    A bijective 64-bit finalizer over seed + (step + 1) * golden, so different steps of one seed never
    collide, and small seeds with small steps do not either.
    """
    return mix64((seed & _MASK64) + (step + 1) * _GOLDEN)


def _signed64(v: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits on int64 tensors as unsigned 64-bit patterns (torch's >> keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The noise's uniforms (float64 [n, w]) at token ids `ids` (int64 [n, w]) of rows keyed by `keys` (int64
    [n], `noise_seed`s as `_signed64` holds them): (2 * (h >> 12) + 1) * 2^-53, h = `mix64`(key + (id + 1) *
    golden), in int64 ops that wrap as uint64's do (checked against Python's integers by a test), on
    any device. cpp_experts.noise_uniforms is the same function natively."""
    z = keys[:, None] + (ids + 1) * _signed64(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed64(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return (_shr(z, 12) * 2 + 1).to(torch.float64) * 2.0**-53


def mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def apply_logit_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps before the sampling choice, on an fp32 copy of `logits` [B, V] (the input is untouched):

    1. logit_bias added; ids outside allowed_token_ids, and each bad word's last id right after its
       others, get -inf;
    2. repetition_penalty (HF/CTRL: every id in prompt + output, logit / p if logit > 0 else logit * p),
       then frequency_penalty (minus p * count in output) and presence_penalty (minus p if in output);
    3. min_tokens: while len(output_ids) < min_tokens, EOS ids and stop_token_ids get -inf.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, V], got {tuple(logits.shape)}")
    out = logits.to(torch.float32, copy=True)
    _add_logit_bias(out, rows)
    _mask_token_choices(out, rows)
    _apply_repetition_penalty(out, rows)
    _apply_frequency_presence_penalties(out, rows)
    _mask_until_min_tokens(out, rows)
    return out


def _none_left(x: torch.Tensor, narrow: list[int]) -> tuple[int, ...]:
    """Those of the rows `narrow` whose logits in `x` are all -inf: nothing the request allows may come."""
    if not narrow:
        return ()
    empty = torch.isneginf(_take(x, narrow).amax(dim=-1)).tolist()
    return tuple(i for i, none_left in zip(narrow, empty) if none_left)


class Sampler:
    """Chooses the next token of every row of a batch; stateless apart from cached generators."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generators: dict[torch.device, torch.Generator] = {}
        # the last two logits tensors checked, with their widths: the native CPU decode returns the same
        # two buffers in turn (executor.cpu_forward), whose checks would be a decode step's only torch calls
        self._checked: tuple[tuple[torch.Tensor, int, int], ...] = ()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 argmax: Sequence[int] | None = None) -> SampleResult:
        """`logits` [B, V >= vocab_size] on this sampler's device type; one token per row. `argmax`: the
        logits' row-wise argmax where the forward already found it (the native CPU forward's LM head,
        cpp_experts/csrc/linear_calls.h says why): a batch of plain greedy rows then takes it instead
        of reading every logit again."""
        width = self._check(logits, len(rows))
        if not rows:
            return SampleResult(token_ids=[], logprobs=[])

        if argmax is not None and len(argmax) != len(rows):
            raise ValueError(f"argmax has {len(argmax)} entries for {len(rows)} rows")
        masked = any(row.grammar is not None for row in rows)
        plain = all(row.params.greedy and not _processed(row) for row in rows)
        # the forward's argmax is of the unmasked logits, every column: it stands where those are the vocabulary
        if plain and argmax is not None and not masked and width == self.vocab_size:
            tokens = list(argmax)
            return SampleResult(token_ids=tokens, logprobs=_logprobs(logits, rows, tokens))
        raw = logits[:, : self.vocab_size]
        if masked:  # first: logprobs and every later step see the mask
            raw = raw.to(torch.float32, copy=True)
            apply_grammar_masks(raw, [row.grammar for row in rows])
        if plain:  # the common decode: argmax alone
            tokens = argmax_rows(raw)
            grammared = [i for i, row in enumerate(rows) if row.grammar is not None] if masked else []
            return SampleResult(token_ids=tokens, logprobs=_logprobs(raw, rows, tokens), no_choice=_none_left(raw, grammared))
        # the processors work on a copy; with none to apply, the draw reads the logits where they are
        unprocessed = raw.dtype == torch.float32 and not any(_processed(row) for row in rows)
        x = raw if unprocessed else apply_logit_processors(raw, rows)
        # Only a row whose candidates are few can be left with none (allowed_token_ids a bad word or the
        # grammar forbids now, bad words over a grammar's few ids, a grammar with a dead end): argmax would
        # pick id 0 there
        no_choice = _none_left(x, [i for i, row in enumerate(rows) if row.params.allowed_token_ids or row.grammar is not None])
        tokens = [0] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        for i, token in zip(greedy, argmax_rows(_take(x, greedy)) if greedy else ()):
            tokens[i] = token
        for i, token in zip(random, self._sample(x, random, [rows[i] for i in random]) if random else ()):
            tokens[i] = token
        return SampleResult(token_ids=tokens, logprobs=_logprobs(raw, rows, tokens), no_choice=no_choice)

    def _check(self, logits: torch.Tensor, n: int) -> int:
        """Checks that `logits` are [n, V >= vocab_size] on this sampler's device type; returns V."""
        for seen, rows, width in self._checked:  # the same object checked before (nothing here resizes one)
            if logits is seen and rows == n:
                return width
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [num_rows={n}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}")
        if logits.device.type != self.device.type:
            raise ValueError(f"logits are on {logits.device}, the sampler was made for {self.device}")
        width = int(logits.shape[1])
        self._checked = ((logits, n, width), *self._checked[:1])
        return width

    def _sample(self, x: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> list[int]:
        """The tokens of rows `idx` of x [B, V] fp32 (not changed), whose settings are `rows`: temperature,
        top_k, top_p, min_p, then Gumbel-max; natively on the CPU (`_NATIVE`), else by `_draw`."""
        keys = [noise_seed(row.seed, row.step) for row in rows]
        temps = [max(row.params.temperature, _MIN_TEMPERATURE) for row in rows]
        if not (_NATIVE and x.device.type == "cpu"):
            return self._draw(_take(x, idx), rows, keys, temps)
        if x.stride(1) != 1:
            x = x.contiguous()
        tokens = cpp_experts.sample_rows(x, idx, temps, [row.params.top_k for row in rows],
                                         [row.params.top_p for row in rows], _log_min_ps(rows), keys)
        left = [j for j, token in enumerate(tokens) if token < 0]
        if left:  # a NaN or infinite logit: csrc/sample.h
            drawn = self._draw(_take(x, [idx[j] for j in left]), [rows[j] for j in left], [keys[j] for j in left],
                               [temps[j] for j in left])
            for j, token in zip(left, drawn):
                tokens[j] = token
        return tokens

    def _draw(self, x: torch.Tensor, rows: Sequence[SamplingRow], keys: list[int], temps: list[float]) -> list[int]:
        """The definition of the draw, in torch ops: x [n, V] fp32 (not changed), one row per `rows`."""
        x = x / _column(temps, x)
        key = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64).to(x.device, non_blocking=True)
        vocab = x.shape[1]
        if not _CANDIDATES:
            every = torch.arange(vocab, device=x.device).expand(len(rows), vocab)
            noise = _gumbel(counter_uniforms(key, every))
            return _min_p(_top_k_top_p(x, rows), rows).double().add_(noise).argmax(dim=-1).tolist()
        # Rows with a top_k or top_p pick among their candidates (the best few, sorted: `_top_k_top_p`'s),
        # with those tokens' noise alone: the rest are -inf, and -inf plus noise stays -inf.
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        with_k, p_only, rest = _filter_groups(rows, vocab)
        for chosen in (with_k, p_only):
            if chosen:
                picked = [rows[i] for i in chosen]
                values, ids, drop = _top_k_top_p_candidates(_take(x, chosen), picked)
                drop |= values - values[:, :1] < _log_min_p(picked, x)  # min_p (`_min_p`) among them
                noise = _gumbel(counter_uniforms(_take(key, chosen), ids))
                score = values.double().add_(noise).masked_fill_(drop, float("-inf"))
                _put(tokens, chosen, _first_best(score, ids, vocab))
        if rest:
            picked = [rows[i] for i in rest]
            every = torch.arange(vocab, device=x.device).expand(len(rest), vocab)
            noise = _gumbel(counter_uniforms(_take(key, rest), every))
            _put(tokens, rest, _min_p(_take(x, rest), picked).double().add_(noise).argmax(dim=-1))
        return tokens.tolist()


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(-log(u)) from uniforms in (0, 1), in place."""
    return u.log_().neg_().log_().neg_()


def _add_logit_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        for tok, b in row.params.logit_bias.items():
            row_idx.append(i)
            tok_idx.append(tok)
            bias.append(b)
    if row_idx:
        index = _index(row_idx, tok_idx, x, "logit_bias")
        x.index_put_(index, torch.tensor(bias, dtype=x.dtype).to(x.device), accumulate=True)


def _mask_token_choices(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """vLLM's allowed_token_ids (every other id -inf) and bad_words (a word's last id -inf where the
    output ends with the word's other ids; a one-id word always)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=x.device)
            kept = x[i, keep].clone()
            x[i].fill_(float("-inf"))
            x[i, keep] = kept
        if p.bad_words_ids:
            out = row.output_ids
            banned = [w[-1] for w in p.bad_words_ids
                      if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1])]
            if banned:
                x[i, torch.tensor(banned, dtype=torch.long, device=x.device)] = float("-inf")


def _apply_repetition_penalty(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Gather-transform-scatter over the distinct seen ids only: no [B, V] pass."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    penalty: list[float] = []
    for i, row in enumerate(rows):
        if row.params.repetition_penalty != 1.0:
            seen = {*row.prompt_ids, *row.output_ids}
            row_idx.extend([i] * len(seen))
            tok_idx.extend(seen)
            penalty.extend([row.params.repetition_penalty] * len(seen))
    if row_idx:
        index = _index(row_idx, tok_idx, x, "prompt/output ids")
        values = x[index]
        p = torch.tensor(penalty, dtype=x.dtype).to(x.device, non_blocking=True)
        x[index] = torch.where(values > 0, values / p, values * p)


def _apply_frequency_presence_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """x[r, t] -= frequency * count + presence, for the distinct ids t of row r's output."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    amount: list[float] = []
    for i, row in enumerate(rows):
        frequency, presence = row.params.frequency_penalty, row.params.presence_penalty
        if frequency != 0.0 or presence != 0.0:
            for tok, count in Counter(row.output_ids).items():
                row_idx.append(i)
                tok_idx.append(tok)
                amount.append(frequency * count + presence)
    if row_idx:
        index = _index(row_idx, tok_idx, x, "output ids")
        x.index_put_(index, -torch.tensor(amount, dtype=x.dtype).to(x.device, non_blocking=True), accumulate=True)


def _mask_until_min_tokens(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        # a document's grammar decides where EOS may come (masking it could leave a row with nothing allowed);
        # free text under a structural tag may end anywhere outside its tags, as text without one
        if len(row.output_ids) < row.params.min_tokens and (row.grammar is None or row.grammar.free):
            banned = set(row.eos_token_ids) | set(row.params.stop_token_ids)
            row_idx.extend([i] * len(banned))
            tok_idx.extend(banned)
    if row_idx:
        x[_index(row_idx, tok_idx, x, "EOS/stop ids")] = float("-inf")


# ---- sampling transforms (step 5) ----------------------------------------------------------------


def _top_k_top_p(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Keep the top_k best, then the smallest best-first set whose mass (after top_k) reaches top_p;
    the best token is always kept; x [n, V] with the rest set to -inf, in place."""
    with_k, p_only, _ = _filter_groups(rows, x.shape[1])
    for chosen in (with_k, p_only):
        if chosen:
            sub = _take(x, chosen)
            _, ids, drop = _top_k_top_p_candidates(sub, [rows[i] for i in chosen])
            removed = torch.ones_like(sub, dtype=torch.bool).scatter_(1, ids, drop)
            _put(x, chosen, sub.masked_fill_(removed, float("-inf")))
    return x


def _filter_groups(rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], list[int], list[int]]:
    """The rows with a top_k (one partial sort: `topk` of their largest k, nothing beyond survives), those
    with top_p alone (another, as wide as their mass needs: `_best_holding`), and the others."""
    with_k = [i for i, row in enumerate(rows) if 1 <= row.params.top_k < vocab]
    p_only = [i for i, row in enumerate(rows) if not 1 <= row.params.top_k < vocab and row.params.top_p < 1.0]
    rest = [i for i, row in enumerate(rows) if not 1 <= row.params.top_k < vocab and row.params.top_p >= 1.0]
    return with_k, p_only, rest


def _top_k_top_p_candidates(x: torch.Tensor, rows: Sequence[SamplingRow]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's best tokens, best first, as far as top_k / top_p may keep them: (values, ids, drop) [n, w],
    drop True where top_k or top_p removes it (every token past them is removed too). The rows are one of
    `_filter_groups`' first two groups.

    top_k keeps every token whose logit reaches the k-th best (as HF's TopKLogitsWarper and vLLM do): a
    token tied with the k-th is kept too, rather than one of the tied dropped by the sort's whim.
    """
    vocab = x.shape[1]
    top_k = [_effective_top_k(row.params.top_k, vocab) for row in rows]
    width = max(top_k)
    kept = _column(top_k, x, torch.long)
    p = _column([row.params.top_p for row in rows], x)
    if width < vocab:  # the top_k group
        sorted_x, order = x.topk(width, dim=-1, sorted=True)
        kth = sorted_x.gather(1, kept - 1)
        # ties with the k-th value (a -inf k-th keeps the finite ones only: the rest can never be drawn)
        kept = ((x >= kth) & (x > float("-inf"))).sum(dim=-1, keepdim=True).clamp_(min=1)
        wider = int(kept.max())
        if wider > width:  # ties run past the partial sort: sort as far as they go
            width = wider
            sorted_x, order = _best_first(x, width)
        else:
            sorted_x, order = _in_id_order(sorted_x, order)
        drop = torch.arange(width, device=x.device)[None, :] >= kept
        mass = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    else:  # top_p alone (`_filter_groups` groups the rows so)
        sorted_x, order, mass = _best_holding(x, p)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    mass_before = mass.roll(1, dims=-1)  # mass of the strictly better tokens
    mass_before[:, 0] = 0.0
    drop |= (mass_before >= p) & (p < 1.0)
    drop[:, 0] = False
    return sorted_x, order, drop


def _best_first(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best `width` (values, ids), best first, equal values in id order; the whole row sorted
    where `width` reaches it."""
    return _in_id_order(*(x.topk(width, dim=-1, sorted=True) if width < x.shape[1] else x.sort(dim=-1, descending=True)))


def _in_id_order(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted candidates (values best first, their ids [n, w]) with equal values in id order: the order top_p's
    running mass counts them in (a sort's own order of ties is its whim), as cpp_experts.sample_rows does."""
    ids, perm = ids.sort(dim=-1)
    values, perm = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, perm)


def _first_best(score: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, the id of the best score [n, w], the smallest id among equals (a NaN counting as the best):
    what argmax over the whole row, by column, picks."""
    hit = (score == score.amax(dim=-1, keepdim=True)) | score.isnan()
    return ids.masked_fill(~hit, vocab).amin(dim=-1)


# top_p alone sorts the best _TOP_P_FIRST tokens of each row first, and more (x4) only where their mass
# falls short of the row's top_p: a full sort of SmolLM2's 49152 logits took 3.3 ms a row on one thread
# (the engine's sampling thread), longer than the model's decode step; its defaults are top_p 0.9
_TOP_P_FIRST = 64
# exp's argument is clamped here: below it torch's CPU exp takes a slow path (10-35x: 8 ms for 16 rows of
# 49152, most of a row at temperature 0.2), and exp(-87) ~ 1.6e-38 per token, 8e-34 over a whole
# vocabulary, moves no probability sum at fp32's precision
_TINY_EXP = -87.0


def _best_holding(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, ids, cumulative probability) of each row's best tokens, best first, enough of them for
    their mass to reach the row's `p` (every token past them is then dropped by top_p), all where it
    does not; probabilities normalised over the whole row."""
    vocab = x.shape[1]
    best = x.amax(dim=-1, keepdim=True)
    log_total = (x - best).clamp_(min=_TINY_EXP).exp_().sum(dim=-1, keepdim=True).log_().add_(best)
    width = min(_TOP_P_FIRST, vocab)
    while True:
        values, ids = _best_first(x, width)
        mass = (values - log_total).clamp_(min=_TINY_EXP).exp_().cumsum(dim=-1)
        if width >= vocab:
            return values, ids, mass
        # enough: the mass reaches p, and the last token kept is not tied with the last one sorted (ties
        # running past the partial sort may hold smaller ids, which go first)
        last = (mass < p).sum(dim=-1, keepdim=True).clamp_(max=width - 1)
        if bool(((mass[:, -1:] >= p) & (values.gather(1, last) > values[:, -1:])).all()):
            return values, ids, mass
        width *= 4


def _min_p(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max, i.e. x - x_max < log(min_p): no softmax, and no exp (whose
    results below FLT_MIN, most of a low temperature's row, take torch's slow path: `_TINY_EXP`)."""
    chosen = [i for i, row in enumerate(rows) if row.params.min_p > 0.0]
    if not chosen:
        return x
    sub = _take(x, chosen)
    log_min_p = _log_min_p([rows[i] for i in chosen], x)
    _put(x, chosen, sub.masked_fill_(sub - sub.amax(dim=-1, keepdim=True) < log_min_p, float("-inf")))
    return x


def _log_min_p(rows: Sequence[SamplingRow], like: torch.Tensor) -> torch.Tensor:
    """[n, 1] `_log_min_ps` as a column on `like`'s device."""
    return _column(_log_min_ps(rows), like)


def _log_min_ps(rows: Sequence[SamplingRow]) -> list[float]:
    """log(min_p) per row, -inf where a row has none (nothing is below it)."""
    return [math.log(row.params.min_p) if row.params.min_p > 0.0 else -math.inf for row in rows]


def _effective_top_k(top_k: int, vocab: int) -> int:
    return top_k if 1 <= top_k < vocab else vocab


# ---- logprobs (step 6) ---------------------------------------------------------------------------


def _logprobs(raw: torch.Tensor, rows: Sequence[SamplingRow], tokens: list[int]) -> list[TokenLogprob | None]:
    """log_softmax of the raw logits: the chosen token's value and the top_logprobs best, best first."""
    result: list[TokenLogprob | None] = [None] * len(rows)
    chosen = [i for i, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs > 0]
    if chosen:
        found = token_logprobs(raw, chosen, [tokens[i] for i in chosen], [rows[i].params.top_logprobs for i in chosen])
        for i, lp in zip(chosen, found):
            result[i] = lp
    return result


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """log_softmax of `logits`' rows `rows` (of [B, V]) at `tokens` (one a row), each with its `top` best
    alternatives, best first (equal logits in id order; -inf ones, which a grammar masks, are no
    alternatives): natively on the CPU (`cpp_experts.row_logprobs`: in bench/sampler_cpu.py a sampler call
    with top_logprobs 5 took 0.09 ms a row against 0.74 in torch), else, and for rows with a NaN, in
    torch. The sampler's and the prompt's logprobs."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    k = min(max(top, default=0), logits.shape[1])
    left = list(range(len(rows)))
    if _NATIVE and logits.device.type == "cpu":
        x = logits if logits.dtype == torch.float32 and logits.stride(1) == 1 else logits.float().contiguous()
        left = []
        for j, found in enumerate(cpp_experts.row_logprobs(x, rows, tokens, k)):
            if found is None:
                left.append(j)
            else:
                out[j] = TokenLogprob(token_id=tokens[j], logprob=found[0], top=found[1][: top[j]])
    if left:
        lp = torch.log_softmax(_take(logits, [rows[j] for j in left]).float(), dim=-1)
        ids = torch.tensor([tokens[j] for j in left], dtype=torch.long).to(logits.device, non_blocking=True)
        picked = lp.gather(1, ids[:, None]).squeeze(1).tolist()
        top_values: list[list[float]] = [[] for _ in left]
        top_ids: list[list[int]] = [[] for _ in left]
        if k > 0:
            values, order = lp.topk(k, dim=-1)
            # ties with the k-th running past it: which of them topk took is its whim, so take them all
            wider = int((lp >= values[:, -1:]).sum(dim=-1).max())
            values, order = _best_first(lp, wider) if wider > k else _in_id_order(values, order)
            top_values, top_ids = values[:, :k].tolist(), order[:, :k].tolist()
        for n, j in enumerate(left):
            alternatives = zip(top_ids[n][: top[j]], top_values[n][: top[j]])
            out[j] = TokenLogprob(token_id=tokens[j], logprob=picked[n], top=[(t, v) for t, v in alternatives
                                                                             if v != -math.inf])
    return out  # type: ignore[return-value]


RANK_ROWS = 32  # rows `token_ranks` compares at once


def token_ranks(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list[int | None]:
    """vLLM's rank of each token in its row of `logits`: how many of the row's logits are at least the
    token's (1: the model's first choice; a tie ranks the token behind the tokens it ties). None for a row
    with a NaN at the token. The prompt's logprobs' ranks (`prompt_logprobs`)."""
    if not rows:
        return []
    # (a prompt chunk's rows are a run, but for its last: a view, where a copy of the rows cost 4x the comparison)
    run = rows == list(range(rows[0], rows[0] + len(rows)))
    x = logits[rows[0] : rows[0] + len(rows)] if run else _take(logits, rows)
    at = x.gather(1, torch.tensor(tokens, dtype=torch.long, device=x.device)[:, None])
    # a few rows at a time: their comparison stays in cache (all of a chunk's rows at once took 5x as long on a
    # CPU, 512 rows of a 49K vocabulary, and on a GPU a chunk against a 129K vocabulary is GBs)
    counts = torch.cat([(x[i:i + RANK_ROWS] >= at[i:i + RANK_ROWS]).sum(dim=-1)
                        for i in range(0, len(rows), RANK_ROWS)]).tolist()
    return [c if c > 0 else None for c in counts]


# ---- small tensor helpers ------------------------------------------------------------------------


def _processed(row: SamplingRow) -> bool:
    """Whether any logit processor (apply_logit_processors) changes this row's logits."""
    p = row.params
    return bool(p.logit_bias) or bool(p.allowed_token_ids) or bool(p.bad_words_ids) \
        or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 \
        or p.presence_penalty != 0.0 or len(row.output_ids) < p.min_tokens


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Row-wise argmax (the first of equal maxima, NaN counting as the largest, as torch's): through
    numpy for fp32 CPU rows, ~10x faster than torch's argmax on one 50k-wide row."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(dim=-1).tolist()


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]; no copy when `rows` is every row in order."""
    if len(rows) == t.shape[0] and rows[-1] == len(rows) - 1:
        return t
    return t[torch.tensor(rows, device=t.device)]


def _put(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """t[rows] = values, in place."""
    if len(rows) == t.shape[0] and rows[-1] == len(rows) - 1:
        if values is not t:  # `values` may be `_take`'s no-copy view, changed in place
            t.copy_(values)
        return
    t[torch.tensor(rows, device=t.device)] = values


def _column(values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [n, 1] tensor on `like`'s device, to broadcast a per-row parameter."""
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)[:, None]


def _index(row_idx: list[int], tok_idx: Iterable[int], x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token ids) index tensors on x's device, ids checked on the CPU first (a bad id on CUDA
    would be a device-side assert that kills the process)."""
    toks = torch.tensor(list(tok_idx), dtype=torch.long)
    vocab = x.shape[1]
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= vocab):
        raise ValueError(f"{what} contain a token id outside 0..{vocab - 1}")
    rows_t = torch.tensor(row_idx, dtype=torch.long)
    return rows_t.to(x.device, non_blocking=True), toks.to(x.device, non_blocking=True)
