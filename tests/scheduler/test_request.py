"""`Req`'s token views."""

from __future__ import annotations

import random

from scheduler.request import Req
from scheduler.sampling_params import SamplingParams


def test_ids_is_a_slice_of_all_ids_without_joining_them():
    rng = random.Random(3)
    for n_prompt, n_out in ((0, 4), (5, 0), (6, 3), (1, 1)):
        r = Req("r", 0, [rng.randrange(1000, 9000) for _ in range(n_prompt)], SamplingParams(), seed=1)
        r.output_ids = [rng.randrange(1000, 9000) for _ in range(n_out)]
        total = n_prompt + n_out
        for start in range(total + 1):
            assert r.ids(start) == r.all_ids[start:]
            for end in range(start, total + 1):
                assert r.ids(start, end) == r.all_ids[start:end]
    r.output_ids.append(5)  # a decode step's input: the last token, from the outputs alone
    assert r.ids(r.seq_len - 1) == [5]
