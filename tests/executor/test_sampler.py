"""The batched sampler against references nobody here wrote (HF transformers' logits processors and
warpers, torch's log_softmax) and against definitions recomputed independently in numpy.

Random logits come from seeded generators, so every statistical check is reproducible.
"""

from __future__ import annotations

import math
import random
from msgspec.structs import replace

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from executor.sampler import (RANK_ROWS, Sampler, SamplingRow, _min_p, _top_k_top_p, apply_logit_processors, noise_seed,
                              token_ranks)
from scheduler.sampling_params import SamplingParams

EOS = 3


def _logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _row(params: SamplingParams | None = None, seed: int = 0, step: int = 0, prompt=(), output=(),
         eos=(EOS,)) -> SamplingRow:
    return SamplingRow(params=params or SamplingParams(), seed=seed, step=step, prompt_ids=list(prompt),
                       output_ids=list(output), eos_token_ids=list(eos))


def _np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def _reference_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Kept-token mask by the definitions, in float64, plus a check that no token sits on a boundary."""
    z = logits.astype(np.float64) / temperature
    vocab = z.size
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(vocab, dtype=bool)
    keep[order[: (vocab if top_k < 1 else min(top_k, vocab))]] = True
    if top_p < 1.0:
        p = _np_softmax(np.where(keep, z, -np.inf))
        before = 0.0
        for tok in order:  # keep the best tokens until their mass reaches top_p
            if not keep[tok]:
                continue
            if before >= top_p:
                keep[tok] = False
            assert abs(before - top_p) > 1e-4, "test logits put a token on the top_p boundary"
            before += p[tok]
        keep[order[0]] = True
    if min_p > 0.0:
        p = _np_softmax(np.where(keep, z, -np.inf))
        ratio = p / p.max()
        assert np.all(np.abs(ratio[keep] - min_p) > 1e-4), "test logits put a token on the min_p boundary"
        keep &= ratio >= min_p
    return keep


def _hf_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """HF generate's warper chain (temperature, top_k, top_p, min_p) on [B, V] scores."""
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k >= 1:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    if min_p > 0.0:
        x = MinPLogitsWarper(min_p)(None, x)
    return x


def _chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.72 is the 1e-4 tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _draw_counts(logits_row: torch.Tensor, params: SamplingParams, draws: int, seed: int,
                 companion: SamplingParams | None = None) -> np.ndarray:
    """Counts of `draws` tokens of one seeded request over consecutive steps, sampled as one batch
    (interleaved with as many rows of `companion` params, whose tokens are not counted)."""
    vocab = logits_row.numel()
    rows = [_row(params, seed=seed, step=s) for s in range(draws)]
    if companion is not None:
        rows = [r for pair in zip(rows, [_row(companion, seed=s) for s in range(draws)]) for r in pair]
    tokens = Sampler(vocab)(logits_row.expand(len(rows), vocab), rows).token_ids
    return np.bincount(tokens[:: 1 if companion is None else 2], minlength=vocab)


# ---- greedy ---------------------------------------------------------------------------------------


def test_top_k_one_and_temperature_zero_are_argmax() -> None:
    logits = _logits(16, 50, seed=1)
    sampler = Sampler(50)
    expected = logits.numpy().argmax(axis=1).tolist()
    top_k_1 = [_row(SamplingParams(temperature=1.3, top_k=1), seed=i, step=i) for i in range(16)]
    temp_0 = [_row(SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2), seed=i) for i in range(16)]
    assert sampler(logits, top_k_1).token_ids == expected
    assert sampler(logits, temp_0).token_ids == expected
    tiny_t = [_row(SamplingParams(temperature=9e-6), seed=i, step=i) for i in range(16)]  # greedy, as vLLM
    near = logits.clone()
    near[:, 0] = near.amax(dim=-1) - 1e-5  # a runner-up 1e-5 below the best: a draw at 1e-5 would take it often
    assert sampler(near, tiny_t).token_ids == near.numpy().argmax(axis=1).tolist()
    tiny_top_p = [_row(SamplingParams(temperature=1.0, top_p=1e-3), seed=i, step=i) for i in range(16)]
    assert sampler(logits, tiny_top_p).token_ids == expected  # the best token is always kept
    zero_top_p = [_row(SamplingParams(temperature=1.0, top_p=0.0), seed=i, step=i) for i in range(16)]
    assert sampler(logits, zero_top_p).token_ids == expected  # OpenAI takes 0 (it was a 400): the best alone


def test_greedy_is_argmax_of_processed_logits() -> None:
    logits = _logits(4, 40, seed=2)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=1.5, presence_penalty=0.5,
                            logit_bias={7: 1.5, 8: -3.0})
    rows = [_row(params, prompt=[1, 2, 5], output=list(logits[i].topk(3).indices.tolist()) * 2) for i in range(4)]
    processed = apply_logit_processors(logits, rows)
    assert Sampler(40)(logits, rows).token_ids == processed.numpy().argmax(axis=1).tolist()
    assert not torch.equal(processed, logits)  # the penalties did move the chosen tokens


def test_the_forwards_argmax_serves_plain_greedy_rows_only() -> None:
    """A forward that found its logits' argmax (the native CPU forward's LM head) hands it over: plain
    greedy rows take it as it is (a deliberately different list shows it is the one used); a row whose
    logits a processor changes, or a batch whose logits are wider than the vocabulary, takes the argmax
    of what it samples from."""
    logits = _logits(3, 40, seed=5)
    best = logits.numpy().argmax(axis=1).tolist()
    other = [(b + 1) % 40 for b in best]
    greedy = [_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler(40)(logits, greedy).token_ids == best
    assert Sampler(40)(logits, greedy, argmax=other).token_ids == other
    biased = [_row(SamplingParams(temperature=0.0, logit_bias={5: -100.0})) for _ in range(3)]
    want = apply_logit_processors(logits, biased).numpy().argmax(axis=1).tolist()
    assert Sampler(40)(logits, biased, argmax=other).token_ids == want
    assert Sampler(36)(logits, greedy, argmax=other).token_ids == logits[:, :36].numpy().argmax(axis=1).tolist()
    with pytest.raises(ValueError, match="argmax has 2 entries for 3 rows"):
        Sampler(40)(logits, greedy, argmax=other[:2])


# ---- seeded reproducibility -----------------------------------------------------------------------


def _mixed_rows(n: int, rng: random.Random) -> list[SamplingRow]:
    choices = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.2, top_p=0.8, logprobs=True, top_logprobs=3),
        SamplingParams(min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(top_k=20, top_p=0.9, min_p=0.02, presence_penalty=1.0, logit_bias={4: 2.0}),
    ]
    return [_row(rng.choice(choices), seed=rng.randrange(2**63), step=rng.randrange(100),
                 prompt=[rng.randrange(64) for _ in range(5)], output=[rng.randrange(64) for _ in range(3)])
            for _ in range(n)]


def test_seeded_token_does_not_depend_on_the_batch() -> None:
    rng = random.Random(3)
    vocab = 64
    rows = _mixed_rows(12, rng)
    logits = _logits(12, vocab, seed=3)
    sampler = Sampler(vocab)
    alone = [sampler(logits[i : i + 1], [rows[i]]) for i in range(12)]

    others = _mixed_rows(9, rng)
    other_logits = _logits(9, vocab, seed=4)
    batch = [(logits[i], rows[i], i) for i in range(12)] + [(other_logits[j], others[j], None) for j in range(9)]
    for _ in range(3):
        rng.shuffle(batch)
        result = sampler(torch.stack([b[0] for b in batch]), [b[1] for b in batch])
        for pos, (_, _, i) in enumerate(batch):
            if i is not None:
                assert result.token_ids[pos] == alone[i].token_ids[0]
                assert result.logprobs[pos] == alone[i].logprobs[0]


def test_different_seeds_give_different_tokens() -> None:
    vocab = 100
    logits = _logits(1, vocab, seed=5, scale=0.3).expand(64, vocab)
    sampler = Sampler(vocab)
    a = sampler(logits, [_row(seed=11, step=s) for s in range(64)]).token_ids
    b = sampler(logits, [_row(seed=12, step=s) for s in range(64)]).token_ids
    assert sum(x == y for x, y in zip(a, b)) < 8  # about 0.7 expected by chance
    assert len(set(a)) > 30 and len(set(b)) > 30  # the steps of one seed draw fresh noise too
    assert sampler(logits, [_row(seed=11, step=s) for s in range(64)]).token_ids == a


WAYS = {"native": (True, True), "candidates": (False, True), "whole rows": (False, False)}  # (_NATIVE, _CANDIDATES)


def _each_way(monkeypatch, vocab: int, logits: torch.Tensor, rows: list[SamplingRow], ways=WAYS) -> dict[str, list[int]]:
    import executor.sampler as sampler_module

    picked = {}
    for way in ways:
        native, candidates = WAYS[way]
        monkeypatch.setattr(sampler_module, "_NATIVE", native)
        monkeypatch.setattr(sampler_module, "_CANDIDATES", candidates)
        picked[way] = Sampler(vocab)(logits.clone(), rows).token_ids
    return picked


@pytest.mark.parametrize("vocab", [97, 49152])
def test_drawing_among_the_candidates_picks_what_whole_rows_pick(monkeypatch, vocab: int) -> None:
    """Rows with a top_k or top_p draw among their few candidates, with those tokens' noise alone, natively
    on the CPU or in torch: against the definition (every row whole: filtered to -inf, noise at every column,
    argmax), every row picks the same token: mixed filters and min_p, ties (the smallest id wins, as argmax's
    first), a row with one allowed token, -inf logits among the candidates, rows with no filter, greedy rows
    between."""
    import executor.sampler as sampler_module

    rng = random.Random(vocab)
    n = 48
    logits = _logits(n, vocab, seed=vocab, scale=3.0)
    logits[3] = logits[3].round()  # ties in the scores: equal logits whose noise clamps alike are rare,
    logits[4, : vocab // 2] = float("-inf")  # so those are made below
    rows = []
    for i in range(n):
        params = SamplingParams(temperature=rng.choice([0.0, 0.2, 0.7, 1.0, 1.5]),
                                top_k=rng.choice([-1, -1, 1, 5, 50]), top_p=rng.choice([1.0, 0.5, 0.9, 0.99]),
                                min_p=rng.choice([0.0, 0.0, 0.05, 0.3]))
        rows.append(_row(params, seed=rng.randrange(2**40), step=rng.randrange(100)))
    rows[5] = _row(SamplingParams(temperature=0.8, top_p=0.9, allowed_token_ids=[7]), seed=5)
    rows[6] = _row(SamplingParams(temperature=0.8, top_k=3, logit_bias={11: 100.0, 12: 100.0}), seed=6)
    picked = _each_way(monkeypatch, vocab, logits, rows)
    assert picked["native"] == picked["candidates"] == picked["whole rows"]
    assert picked["candidates"][5] == 7 and picked["candidates"][6] in (11, 12)
    assert len(set(picked["candidates"])) > 12

    # exact ties of the noisy scores: equal logits with equal uniforms (set where the noise is drawn, so
    # both torch ways see them), the largest at every third column
    def tied(keys, ids):
        return torch.where(ids % 3 == 0, 0.99, 0.5).to(torch.float64)

    monkeypatch.setattr(sampler_module, "counter_uniforms", tied)
    flat = torch.zeros(4, vocab)
    flat[:, ::7] = 1.0
    rows = [_row(SamplingParams(temperature=1.0, top_k=k), seed=k) for k in (3, 20, 50)] + \
        [_row(SamplingParams(temperature=1.0, top_p=0.5), seed=9)]
    picked = _each_way(monkeypatch, vocab, flat, rows, ways=("candidates", "whole rows"))
    assert picked["candidates"] == picked["whole rows"]
    assert picked["candidates"][:3] == [0, 0, 0]  # top_k keeps every token tied with the k-th: 0 among them


def test_noise_is_the_same_function_natively_in_torch_and_in_python() -> None:
    """The uniforms behind the noise (`counter_uniforms`, torch int64 ops that must wrap as uint64's do, and
    cpp_experts.noise_uniforms) against the definition in Python's integers, on keys across all 64 bits and
    ids up to 2^31: equal bits, odd multiples of 2^-53, inside (0, 1)."""
    from executor.sampler import _GOLDEN, _MASK64, _signed64, counter_uniforms, mix64
    import cpp_experts

    rng = random.Random(21)
    keys = [rng.randrange(2**64) for _ in range(6)] + [0, 2**63, 2**64 - 1]
    ids = torch.tensor([[rng.randrange(2**31) for _ in range(40)] + [0, 1, 2**31 - 1] for _ in keys], dtype=torch.int64)
    want = torch.tensor([[(2 * (mix64((k + (int(j) + 1) * _GOLDEN) & _MASK64) >> 12) + 1) * 2.0**-53 for j in row]
                         for k, row in zip(keys, ids)], dtype=torch.float64)
    got = counter_uniforms(torch.tensor([_signed64(k) for k in keys], dtype=torch.int64), ids)
    assert torch.equal(got, want)
    assert torch.equal(cpp_experts.noise_uniforms(keys, ids, ids.shape[1]), want)
    assert torch.equal(cpp_experts.noise_uniforms(keys, None, 50), counter_uniforms(
        torch.tensor([_signed64(k) for k in keys]), torch.arange(50).expand(len(keys), 50)))
    assert bool(((want > 0) & (want < 1)).all()) and bool(((want * 2.0**53) % 2 == 1).all())
    assert len(set(want.flatten().tolist())) == want.numel()


@pytest.mark.parametrize("vocab", [300, 49152])
def test_the_native_draw_is_the_torch_definitions(monkeypatch, vocab: int) -> None:
    """cpp_experts.sample_rows against the torch definition (`_draw`, candidates and whole rows) on many rows
    of every kind it handles: top_k below and above its heap's 256 (with fewer finite logits than k too),
    top_p from 0 to 0.999 whose cut falls after one token or thousands, ties at the cut (integer logits: equal
    logits go in id order), min_p, temperatures from 1e-5 to 50, -inf stretches, logits padded past the
    vocabulary (strided rows), a flat row without filters (every token's noise tested against the best's
    score); and the rows it leaves to torch (NaN, inf after the division) come back drawn all the same."""
    rng = random.Random(vocab + 1)
    n = 160
    gen = torch.Generator().manual_seed(vocab)
    scales = torch.tensor([rng.choice([0.05, 0.5, 1.0, 2.0, 4.0, 8.0]) for _ in range(n)])[:, None]
    logits = torch.randn(n, vocab + 13, generator=gen) * scales
    for i in range(0, n, 9):
        logits[i] = logits[i].round()  # ties everywhere, at top_p's cut too
    for i in range(4, n, 11):
        logits[i, rng.randrange(vocab) :] = float("-inf")
    logits[7, : vocab - 5] = float("-inf")  # 5 finite, top_k larger
    logits[8, 3] = float("nan")
    logits[10, 9] = 3e38  # inf after the division
    rows = []
    for i in range(n):
        top_k = rng.choice([-1, -1, 0, 1, 2, 7, 40, 255, 256, 257, 700, vocab - 1, vocab, vocab + 5])
        params = SamplingParams(temperature=rng.choice([1e-5, 0.2, 0.7, 1.0, 1.3, 3.0, 50.0]), top_k=top_k,
                                top_p=rng.choice([1.0, 1.0, 0.0, 0.3, 0.9, 0.95, 0.999]),
                                min_p=rng.choice([0.0, 0.0, 0.01, 0.2, 1.0]))
        rows.append(_row(params, seed=rng.randrange(2**64), step=rng.randrange(10**6)))
    rows[7] = _row(SamplingParams(temperature=1.0, top_k=20, top_p=0.9), seed=7)
    rows[10] = _row(SamplingParams(temperature=0.5), seed=10)
    rows[11] = _row(SamplingParams(temperature=50.0), seed=11)  # flat: most tokens' noise must be tested
    picked = _each_way(monkeypatch, vocab, logits, rows)
    assert picked["native"] == picked["candidates"] == picked["whole rows"]
    assert len(set(picked["native"])) > n // 3
    assert 0 <= picked["native"][7] and vocab - 5 <= picked["native"][7] < vocab
    # the native call drew every sampled row itself but the NaN and the infinite one
    import cpp_experts
    from executor.sampler import noise_seed

    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    native = cpp_experts.sample_rows(
        logits[:, :vocab], sampled, [max(rows[i].params.temperature, 1e-5) for i in sampled],
        [rows[i].params.top_k for i in sampled], [rows[i].params.top_p for i in sampled],
        [math.log(rows[i].params.min_p) if rows[i].params.min_p > 0 else -math.inf for i in sampled],
        [noise_seed(rows[i].seed, rows[i].step) for i in sampled])
    assert {i for i, token in zip(sampled, native) if token < 0} == {8, 10}
    assert [token for i, token in zip(sampled, native) if token >= 0] == \
        [picked["candidates"][i] for i, token in zip(sampled, native) if token >= 0]


def test_noise_seeds_do_not_collide_on_small_grids() -> None:
    seeds = {noise_seed(seed, step) for seed in range(-20, 200) for step in range(200)}
    assert len(seeds) == 220 * 200
    assert all(0 <= s < 2**64 for s in seeds)


# ---- distribution and filters ---------------------------------------------------------------------


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    vocab, draws, temperature = 8, 4000, 0.6
    logits = _logits(1, vocab, seed=6, scale=1.0)[0]
    counts = _draw_counts(logits, SamplingParams(temperature=temperature), draws, seed=123)
    expected = _np_softmax(logits.double().numpy() / temperature) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(vocab - 1), (counts, expected)
    assert 0.5 * np.abs(counts / draws - expected / draws).sum() < 0.05


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.8, -1, 0.7, 0.0), (1.0, 6, 0.7, 0.0), (1.0, -1, 1.0, 0.15),
     (1.3, 12, 0.85, 0.05), (1.5, 4, 0.99, 0.405)],
)
def test_filters_keep_exactly_the_reference_set(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    vocab, draws = 32, 3000
    logits = _logits(1, vocab, seed=7, scale=1.5)[0]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    keep = _reference_kept(logits.numpy(), temperature, top_k, top_p, min_p)
    hf_keep = torch.isfinite(_hf_filtered(logits[None], temperature, top_k, top_p, min_p))[0].numpy()
    np.testing.assert_array_equal(keep, hf_keep)
    assert 1 < keep.sum() < vocab  # the case does filter something, and keeps a choice

    # companions with a wider top_k share the filtering pass: each row must still get its own top_k
    companion = SamplingParams(temperature=0.9, top_k=25, top_p=0.95, min_p=0.01)
    counts = _draw_counts(logits, params, draws, seed=99, companion=companion)
    assert counts[~keep].sum() == 0, f"excluded tokens drawn: {np.nonzero(counts * ~keep)[0]}"
    expected = _np_softmax(np.where(keep, logits.double().numpy() / temperature, -np.inf)) * draws
    frequent = expected > 5
    assert np.all(counts[frequent] > 0)
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < _chi2_critical(max(int(keep.sum()) - 1, 1)), (counts, expected)


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_hf_does() -> None:
    """Logits rounded to bf16 tie often (as a GPU's bf16 LM head gives them): top_k keeps every token
    whose logit reaches the k-th best, as HF's TopKLogitsWarper (and vLLM) do; one of the tied used to be
    dropped by the partial sort. Also when the ties run past k (a wider sort) and with a companion row
    of another k in the same pass."""
    vocab = 64
    logits = (_logits(32, vocab, seed=41, scale=1.0) * 4).round() / 4  # many exact ties
    ties = 0
    for k in (1, 2, 3, 5, 8):
        rows = [_row(SamplingParams(temperature=1.0, top_k=k if i % 2 else 3), seed=i) for i in range(32)]
        kept = torch.isfinite(_top_k_top_p(logits.clone(), rows))
        for i, row in enumerate(rows):
            want = torch.isfinite(TopKLogitsWarper(row.params.top_k)(None, logits[i:i + 1].clone()))[0]
            assert torch.equal(kept[i], want), (k, i, logits[i], kept[i], want)
            ties += int(want.sum()) > row.params.top_k
    assert ties > 20  # the case does have ties at the k-th value
    # draws: both of two tokens tied at the k-th value come out
    row = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0, 0.0]])
    sampler = Sampler(6)
    got = {t for i in range(400) for t in sampler(row, [_row(SamplingParams(temperature=1.0, top_k=3), seed=i)]).token_ids}
    assert got == {0, 1, 2, 3}
    # top_k 1 too: it was taken for greedy, whose argmax always gave the lowest of the tied ids
    row = torch.tensor([[1.0, 5.0, 5.0, 3.0, 0.0, 0.0]])
    got = {t for i in range(200) for t in sampler(row, [_row(SamplingParams(temperature=1.0, top_k=1), seed=i)]).token_ids}
    assert got == {1, 2}


def test_a_row_left_with_no_allowed_token_says_so() -> None:
    """allowed_token_ids whose only id a bad word forbids right now: the row is reported in `no_choice`
    (argmax of all -inf would have been id 0, outside allowed_token_ids); the other rows are untouched."""
    vocab = 20
    logits = _logits(3, vocab, seed=5)
    p = SamplingParams(temperature=0.0, allowed_token_ids=(7,), bad_words_ids=((7, 7),))
    sampler = Sampler(vocab)
    for temperature in (0.0, 1.0):
        p = replace(p, temperature=temperature)
        res = sampler(logits, [_row(p, output=[7]), _row(p, output=[]), _row(SamplingParams(temperature=0.0))])
        assert res.no_choice == (0,)
        assert res.token_ids[1] == 7 and res.token_ids[2] == int(logits[2].argmax())


# ---- logit processors -----------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids() -> None:
    vocab = 30
    logits = _logits(200, vocab, seed=8, scale=1.0)
    logits[:, 17] = logits.max(dim=1).values + 5.0  # 17 is everyone's favourite
    runner_up = torch.cat([logits[:, :17], torch.full((200, 1), -math.inf), logits[:, 18:]], dim=1).argmax(dim=1)
    sampler = Sampler(vocab)
    forced = sampler(logits, [_row(SamplingParams(logit_bias={5: 100.0}), seed=i) for i in range(200)])
    assert set(forced.token_ids) == {5}
    forbidden = sampler(logits, [_row(SamplingParams(logit_bias={17: -100.0}), seed=i) for i in range(200)])
    assert 17 not in forbidden.token_ids and len(set(forbidden.token_ids)) > 5
    greedy = sampler(logits, [_row(SamplingParams(temperature=0.0, logit_bias={17: -100.0})) for _ in range(200)])
    assert greedy.token_ids == runner_up.tolist()


def test_allowed_token_ids_and_bad_words() -> None:
    """vLLM's allowed_token_ids (sampled and greedy rows pick only those) and bad_words, against HF's
    NoBadWordsLogitsProcessor on the same output ids (a word's last id banned right after its others)."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    vocab, n = 40, 300
    logits = _logits(n, vocab, seed=21)
    sampler = Sampler(vocab)
    allowed = (2, 9, 31)
    for temperature in (0.0, 1.0):
        got = sampler(logits, [_row(SamplingParams(temperature=temperature, allowed_token_ids=allowed), seed=i)
                               for i in range(n)]).token_ids
        assert set(got) <= set(allowed) and (temperature == 0.0 or set(got) == set(allowed))
    words = ((7,), (11, 12), (4, 5, 6))
    rng = random.Random(3)
    for i in range(n):
        output = [rng.choice([4, 5, 6, 11, 12, 1]) for _ in range(rng.randint(0, 4))]
        row = _row(SamplingParams(temperature=0.0, bad_words_ids=words), output=output)
        ours = apply_logit_processors(logits[i:i + 1], [row])[0]
        hf = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=EOS)(
            torch.tensor([output or [0]]) if output else torch.zeros(1, 0, dtype=torch.long), logits[i:i + 1].clone())[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(hf)), (output, ours, hf)
        assert ours[7] == -math.inf and (ours[12] == -math.inf) == (output[-1:] == [11])
        assert sampler(logits[i:i + 1], [row]).token_ids[0] == int(hf.argmax())


def _reference_processed(logits: list[float], row: SamplingRow) -> list[float]:
    """Steps 1-3 for one row, straight from the definitions, in Python floats."""
    p = row.params
    out = list(logits)
    for tok, bias in p.logit_bias.items():
        out[tok] += bias
    for tok in set(row.prompt_ids) | set(row.output_ids):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(row.output_ids):
        out[tok] -= p.frequency_penalty * row.output_ids.count(tok) + p.presence_penalty
    if len(row.output_ids) < p.min_tokens:
        for tok in set(row.eos_token_ids) | set(p.stop_token_ids):
            out[tok] = -math.inf
    return out


def test_penalties_follow_the_formulas() -> None:
    vocab, batch = 48, 10
    rng = random.Random(9)
    logits = _logits(batch, vocab, seed=9)
    rows = []
    for i in range(batch):
        params = SamplingParams(
            repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.5]),
            frequency_penalty=rng.choice([0.0, 0.7, -1.2]),
            presence_penalty=rng.choice([0.0, 1.5, -0.4]),
            logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randrange(3))},
            min_tokens=rng.choice([0, 4]),
            stop_token_ids=(rng.randrange(vocab),),
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(12))]
        output = [rng.randrange(vocab // 3) for _ in range(rng.randrange(8))]  # repeats likely
        rows.append(_row(params, prompt=prompt, output=output, eos=(EOS, vocab - 1)))
    rows[0] = _row(SamplingParams(frequency_penalty=0.5), output=[2, 2, 2, 9])  # a fixed case as well

    before = logits.clone()
    got = apply_logit_processors(logits, rows)
    assert torch.equal(logits, before)  # the input is not modified
    for i, row in enumerate(rows):
        expected = torch.tensor(_reference_processed(logits[i].tolist(), row))
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-5, msg=f"row {i}: {row}")
    assert got[0, 2] == pytest.approx(logits[0, 2].item() - 1.5)


def test_repetition_penalty_matches_transformers() -> None:
    vocab = 40
    logits = _logits(3, vocab, seed=10)
    rng = random.Random(10)
    rows = [_row(SamplingParams(repetition_penalty=penalty), prompt=[rng.randrange(vocab) for _ in range(9)],
                 output=[rng.randrange(vocab) for _ in range(6)]) for penalty in (1.2, 0.7, 3.0)]
    got = apply_logit_processors(logits, rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([[*row.prompt_ids, *row.output_ids]])
        hf = RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], hf[0], rtol=0, atol=0)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab = 20
    logits = _logits(1, vocab, seed=11, scale=1.0).expand(300, vocab).clone()
    logits[:, EOS] = 30.0
    logits[:, 9] = 29.0  # a stop token id, the runner-up
    sampler = Sampler(vocab)
    for ignore_eos in (False, True):
        params = SamplingParams(min_tokens=4, stop_token_ids=(9,), ignore_eos=ignore_eos)
        early = [_row(params, seed=i, step=i % 4, output=[1] * (i % 4)) for i in range(300)]
        tokens = sampler(logits, early).token_ids
        assert EOS not in tokens and 9 not in tokens
        greedy = replace(params, temperature=0.0)
        allowed = logits[0].clone()
        allowed[[EOS, 9]] = -math.inf
        assert sampler(logits[:1], [_row(greedy, output=[1, 2, 5])]).token_ids == [allowed.argmax().item()]
        assert sampler(logits[:1], [_row(greedy, output=[1, 2, 5, 6])]).token_ids == [EOS]


# ---- logprobs and vocabulary ----------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    vocab = 50
    logits = _logits(6, vocab, seed=12)
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(temperature=0.4, top_k=5, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.0, logit_bias={0: 50.0}, top_logprobs=20),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, top_p=0.5, top_logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    rows = [_row(p, seed=i, prompt=[1, 2], output=[3, 4]) for i, p in enumerate(params)]
    result = Sampler(vocab)(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1).numpy()
    assert result.logprobs[3] is None and result.logprobs[5] is None
    for i, p in enumerate(params):
        lp = result.logprobs[i]
        if lp is None:
            continue
        assert lp.token_id == result.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id], abs=1e-5)
        best = np.argsort(-reference[i], kind="stable")[: p.top_logprobs]
        assert [tok for tok, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], reference[i, best], atol=1e-5)
    assert result.token_ids[2] == 0 and result.logprobs[2].logprob < -1.0  # bias does not touch logprobs
    assert result.logprobs[0].top == []


@pytest.mark.parametrize("vocab", [5, 70, 49152])
def test_token_logprobs_natively_and_in_torch_are_log_softmax(monkeypatch, vocab: int) -> None:
    """`token_logprobs` (the sampler's and the prompt's logprobs), natively on the CPU and in torch, against
    log_softmax in float64: the target's value, the k best best first with equal logits in id order, -inf
    logits (a grammar's mask) no alternatives even where fewer than k are finite, rows strided in padded
    logits; a row with a NaN is left to torch (NaN logprobs, as torch's log_softmax gives)."""
    import executor.sampler as sampler_module
    from executor.sampler import token_logprobs

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab + 3, generator=gen) * 6.0
    logits[1] = logits[1].round()  # ties among the best
    logits[2, 2:] = float("-inf")  # two finite: fewer than k
    logits[3, : vocab // 2] = float("-inf")
    logits[5, 1] = float("nan")
    x = logits[:, :vocab]
    rows, tokens, top = [0, 1, 2, 3, 4, 6, 5], [vocab - 1, 0, 1, vocab - 1, 2, 3, 0], [0, 20, 5, 3, 1, 20, 2]
    reference = torch.log_softmax(x.double(), dim=-1).numpy()
    for native in (True, False):
        monkeypatch.setattr(sampler_module, "_NATIVE", native)
        found = token_logprobs(x, rows, tokens, top)
        for lp, r, t, k in zip(found, rows, tokens, top):
            assert lp.token_id == t
            if r == 5:
                assert math.isnan(lp.logprob)
                continue
            assert lp.logprob == pytest.approx(reference[r, t], abs=2e-5 if not native else 2e-6, rel=1e-6)
            best = [int(i) for i in np.argsort(-reference[r], kind="stable")[:k] if reference[r, i] > -np.inf]
            assert [tok for tok, _ in lp.top] == best, (native, r)
            np.testing.assert_allclose([v for _, v in lp.top], reference[r, best], atol=2e-5)


def test_padded_columns_are_never_sampled() -> None:
    vocab, padded = 24, 32
    logits = _logits(200, padded, seed=13)
    logits[:, vocab:] = 50.0  # garbage in the padding, larger than anything real
    rows = [_row(SamplingParams(temperature=2.0, logprobs=True, top_logprobs=3), seed=i) for i in range(100)]
    rows += [_row(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)) for _ in range(100)]
    result = Sampler(vocab)(logits, rows)
    assert max(result.token_ids) < vocab
    assert result.token_ids[100:] == logits[100:, :vocab].argmax(dim=1).tolist()
    reference = torch.log_softmax(logits[:, :vocab], dim=-1)
    for i, lp in enumerate(result.logprobs):
        assert all(tok < vocab for tok, _ in lp.top)
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-5)


def test_bad_input_is_refused() -> None:
    sampler = Sampler(10)
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        sampler(_logits(1, 8, seed=14), [_row()])
    with pytest.raises(ValueError, match="num_rows=2"):
        sampler(_logits(1, 10, seed=14), [_row(), _row()])
    # a tensor checked before (the native CPU decode's reused logits) is still held to its rows
    again, greedy = _logits(2, 12, seed=15), _row(SamplingParams(temperature=0.0))
    assert sampler(again, [greedy, greedy]).token_ids == again[:, :10].argmax(-1).tolist()
    with pytest.raises(ValueError, match="num_rows=3"):
        sampler(again, [greedy] * 3)
    assert sampler(again, [greedy, greedy], argmax=[1, 2]).token_ids == again[:, :10].argmax(-1).tolist()
    with pytest.raises(ValueError, match="logit_bias"):
        sampler(_logits(1, 12, seed=14), [_row(SamplingParams(logit_bias={11: 1.0}))])
    assert sampler(torch.empty(0, 10), []).token_ids == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_rules() -> None:
    rng = random.Random(15)
    vocab = 1000
    rows = _mixed_rows(32, rng)
    logits = _logits(32, vocab + 24, seed=15).cuda()
    sampler = Sampler(vocab, device="cuda")
    alone = [sampler(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(32)]
    order = list(range(32))
    rng.shuffle(order)
    shuffled = sampler(logits[order], [rows[i] for i in order]).token_ids
    assert [shuffled[order.index(i)] for i in range(32)] == alone
    # the noise is the same integer function on every device: the same logits give the same tokens (bar a
    # top_p cut within fp32 rounding of a running mass, which these rows do not have)
    assert Sampler(vocab)(logits.cpu(), rows).token_ids == alone
    assert all(token < vocab for token in alone)


@pytest.mark.parametrize("temperature", [0.05, 0.2, 0.7, 1.0, 3.0])
def test_top_p_and_min_p_on_a_whole_vocabulary_keep_the_reference_set(temperature: float) -> None:
    """top_p sorts each row's best 64 first and more only where their mass falls short (a whole sort of
    49152 logits took 3.3 ms a row), min_p compares in log space, and exp is clamped below -87 (torch's slow
    path): on rows of the default model's vocabulary whose top_p cut falls after ~1, tens, hundreds, thousands
    of tokens or none, the kept sets are the definitions' (float64, numpy), bar tokens within the fp32 sums'
    error of a boundary (1e-5 of mass after ~17K tokens; the whole sort's sums erred as much)."""
    vocab = 49152
    gen = torch.Generator().manual_seed(int(temperature * 1000))
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.5], [0.1]])
    for top_p, min_p in [(0.9, 0.0), (0.5, 0.0), (0.99, 0.0), (1.0, 0.05), (0.95, 0.01)]:
        rows = [_row(SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p), seed=i) for i in range(6)]
        x = logits / temperature
        kept = torch.isfinite(_min_p(_top_k_top_p(x.clone(), rows), rows)).numpy()
        z = x.double().numpy()
        for i in range(6):
            order = np.argsort(-z[i], kind="stable")
            p = _np_softmax(z[i])
            before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
            want = np.zeros(vocab, dtype=bool)
            want[order] = (before < top_p) | (np.arange(vocab) == 0)
            near = np.zeros(vocab, dtype=bool)
            near[order] = np.abs(before - top_p) < 1e-5
            if min_p > 0.0:
                ratio = p / p.max()
                want &= ratio >= min_p
                near |= np.abs(ratio - min_p) < 1e-6 * min_p
            assert np.array_equal(kept[i] & ~near, want & ~near), (temperature, top_p, min_p, i,
                                                                    int(kept[i].sum()), int(want.sum()))


def test_token_ranks_count_the_tokens_rated_at_least_as_likely():
    """vLLM's rank of a prompt token: 1 + how many tokens have a higher logit, ties counted against it, over
    more rows than one block compares at once; a NaN row has none."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-20, 20, (RANK_ROWS + 37, 50), generator=g).float()  # (many ties)
    rows = list(range(3, logits.shape[0]))
    tokens = torch.randint(0, 50, (len(rows),), generator=g).tolist()
    logits[rows[-1]] = float("nan")
    want = [int((logits[r] >= logits[r, t]).sum()) for r, t in zip(rows, tokens)]
    assert token_ranks(logits, rows, tokens) == want[:-1] + [None]
    assert token_ranks(logits, [], []) == []
