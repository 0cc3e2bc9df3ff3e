"""cpp_experts.sample_rows, row_logprobs and noise_uniforms at their door: what the wrapper and the native layer refuse,
and draws on odd widths (tails of 1..63 values past the 64-value blocks, a single column) that agree with
executor/sampler.py's torch definition. tests/executor/test_sampler.py holds the draw to the definition on
every kind of row; this file also runs under `make asan`."""

from __future__ import annotations

import math
import random

import pytest
import torch

import cpp_experts


def _draw_torch(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, seed: int) -> int:
    import executor.sampler as sampler_module
    from executor.sampler import SamplingRow
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = SamplingRow(params, seed, 0, [], [], [0])
    native = sampler_module._NATIVE
    sampler_module._NATIVE = False
    try:
        return sampler_module.Sampler(x.shape[0])(x[None], [row]).token_ids[0]
    finally:
        sampler_module._NATIVE = native


@pytest.mark.parametrize("vocab", [1, 2, 7, 63, 64, 65, 129, 1000])
def test_odd_widths_draw_what_the_definition_draws(vocab: int) -> None:
    from executor.sampler import noise_seed

    rng = random.Random(vocab)
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(24):
        x = torch.randn(vocab, generator=gen) * rng.choice([0.3, 1.0, 4.0])
        temperature = rng.choice([0.3, 1.0, 2.0])
        top_k = rng.choice([-1, 1, 3, 40, 300])
        top_p = rng.choice([1.0, 0.5, 0.9])
        min_p = rng.choice([0.0, 0.1])
        seed = rng.randrange(2**63)
        got = cpp_experts.sample_rows(x[None], [0], [temperature], [top_k], [top_p],
                                      [math.log(min_p) if min_p else -math.inf], [noise_seed(seed, 0)])
        assert got == [_draw_torch(x, temperature, top_k, top_p, min_p, seed)], (vocab, trial)


def test_bad_calls_are_refused() -> None:
    x = torch.randn(2, 50)
    ok = dict(temperature=[1.0], top_k=[-1], top_p=[1.0], log_min_p=[-math.inf], keys=[1])
    assert len(cpp_experts.sample_rows(x, [1], **ok)) == 1
    with pytest.raises(ValueError, match="float32"):
        cpp_experts.sample_rows(x.double(), [0], **ok)
    with pytest.raises(ValueError, match="rows must lie"):
        cpp_experts.sample_rows(x, [2], **ok)
    with pytest.raises(ValueError, match="columns must be contiguous"):
        cpp_experts.sample_rows(x.t().contiguous().t(), [0], **ok)
    with pytest.raises(ValueError, match="temperatures"):
        cpp_experts.sample_rows(x, [0], **{**ok, "temperature": [0.0]})
    with pytest.raises(ValueError, match="top_p"):
        cpp_experts.sample_rows(x, [0], **{**ok, "top_p": [1.5]})
    with pytest.raises(ValueError, match="one entry per row"):
        cpp_experts.sample_rows(x, [0, 1], **ok)
    with pytest.raises(ValueError, match="int64"):
        cpp_experts.noise_uniforms([1, 2], torch.zeros(2, 3, dtype=torch.int32), 3)
    assert cpp_experts.sample_rows(x, [], [], [], [], [], []) == []
    with pytest.raises(ValueError, match="targets"):
        cpp_experts.row_logprobs(x, [0], [50], 3)
    with pytest.raises(ValueError, match="targets"):
        cpp_experts.row_logprobs(x, [0, 1], [0], 3)
    with pytest.raises(ValueError, match="k must"):
        cpp_experts.row_logprobs(x, [0], [0], 51)
    with pytest.raises(ValueError, match="rows must lie"):
        cpp_experts.row_logprobs(x, [2], [0], 1)
    (value, top), = cpp_experts.row_logprobs(x, [1], [4], 50)  # k = the whole row
    assert [t for t, _ in top] == torch.log_softmax(x[1], -1).argsort(descending=True, stable=True).tolist()
    assert value == pytest.approx(torch.log_softmax(x[1].double(), -1)[4].item(), abs=1e-6)
