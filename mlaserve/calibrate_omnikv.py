"""`mlaserve calibrate-omnikv`: choose OmniKV's filter layers for a model from its own attention.

OmniKV (ICLR 2025) decodes most layers over the tokens a few "filter" layers found important
(models/omnikv_config.py states the plan and the selection). Which layers filter well is a property
of the model, measured here once over real text ("inter-layer attention similarity"):

1. Record. One prefill of up to N tokens of the text through the model's torch forward, with
   `RecordingBackend` (a `TorchAttentionBackend`) as the attention backend. At every layer l and for
   the last Q positions (the observation queries, query i at position p_i, context p_i + 1) it keeps
   the attention probabilities P_l [Q, H, p+1] — per head, the softmax of scale · q·k over the
   positions the query saw — reduced to what the measure needs: max over heads (OmniKV's importance
   with one query, `kernels.attention.omnikv.importance`) and the mean over heads (where the layer's
   attention mass actually goes), 2 · Q · n fp32 per layer. GQA is recorded in `forward_extend`
   (q against the K the pool holds); MLA in `forward_mla_normal`, whose per-head q·k with
   k = (k_nope ‖ k_pe) equals the absorbed score q_latent·c_kv + q_pe·k_pe that decode selects with.

2. Measure. S_l(i) = the tokens decode would keep at layer l as a filter layer for query i: the
   config's rule exactly (`select_positions`: the first `sink_tokens`, the last `recent_tokens`,
   and the k = ceil(R · (p_i + 1)) most important tokens between them by layer l's max-over-heads
   probabilities). Keeping the sink and recent tokens in S_l is deliberate: every layer attends to
   them heavily and decode always keeps them, so ranking layers by a plain top-k would mostly
   reward agreeing on the sinks; with them granted, the measure rates the part of the selection
   that is up to the layer. Then
       cover(l, j)    = mean over i of  sum over s in S_l(i) of mean_h P_j,h(i, s)
       capability(l)  = mean of cover(l, j) over j = l+1 .. min(l + lookahead, L - 1)
   — the share of the next layers' attention mass that l's selection holds — and cover(l, l), the
   mass l's own selection holds, is printed beside it. The last layer has no capability.

   The table is printed and saved; it shows where attention is predictable, but it does not make
   the choice: its queries continue the text, where a model mostly reads nearby tokens, and what
   breaks a sparse decode is a later layer that must read far back (copying a fact, a name, a
   number) while the filter layer above it looked elsewhere. Measured on SmolLM2-135M, the plan
   the table ranked best lost the fact in half of the retrieval prompts that a plan it ranked
   lower kept in all.

3. Choose by decoding. Retrieval probes are made from the text: R windows of C tokens (spread over
   it), each with a fact sentence ("the access key for server <name> is <five digits>", names and
   digits from a seeded generator) put at depth (i + 1/2) / R, then a question asking for it
   (through the model's chat template when it has one, else as plain text). Each probe is prefilled
   once; full attention answers it greedily, G tokens, and its next-token distributions at those
   steps are the reference. Each candidate plan then decodes the same tokens teacher-forced with
   OmniKV over the same prompt KV (the R probes one batch per step) and scores
       score = mean over probes and steps of KL(full || OmniKV)
   of the next-token distributions; the lowest score wins (ties: the lexicographically first).
   Candidates:
   * the first filter layer is `--first-filter` (default L // 5, `models.omnikv_config`): every
     layer before it attends fully, so it sets the decode cost and is the user's choice, not the
     search's (a later one usually scores better and always decodes slower);
   * the other m - 1 filter layers: every placement after it with each filter layer at least 3
     layers after the previous one (the layer after a filter layer attends fully), so each has a
     sparse layer of its own to serve, and the last at most L - 3 (`MIN_GAP`: fixed, `--lookahead`
     spans the table only). When more than `--max-candidates` placements exist, a grid of every s-th
     layer is scored (the least s that fits), then the best is refined by moving one filter layer at
     a time by fewer than s layers while the score improves.
   When no placement of m fits the depth, the most that fit are chosen (a note says so).

The config (`OmniKVConfig`, budget_ratio R, the other settings their defaults) is written with
`save`; its `calibration` field records the model, the text, the counts, the per-layer table, the
probes' settings, the best placements' scores and greedy agreement, and `sparse_mass`: over the
plan's sparse layers j, the mean of cover(filter layer j reads, j) — the attention mass the table
says decode keeps where it attends sparsely.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from executor.model_runner import ModelRunner, RequestSlice
from kernels.attention.base import ForwardBatch
from kernels.attention.omnikv import select_positions
from kernels.attention.torch_backend import TorchAttentionBackend
from mlaserve.argtypes import float_in, positive_int
from mlaserve.model_check import load_model_checked
from models.builtin import user_path
from models.omnikv_config import (
    MAX_FILTER_LAYERS, SPARSE, OmniKVConfig, first_filter_default, model_label, unreadable_file,
)
from server.args import BadSetting, OneLineParser
from server.chat_template import user_turn_ids

if TYPE_CHECKING:
    from models.loader.load import LoadedModel

PROG = "mlaserve calibrate-omnikv"
MIN_TOKENS = 256  # shorter texts give too few long-context queries to rank layers by
DEFAULT_TOKENS = 4096
DEFAULT_QUERIES = 32
DEFAULT_LOOKAHEAD = 4
DEFAULT_PROBES = 6
DEFAULT_PROBE_TOKENS = 2048
DEFAULT_ANSWER_TOKENS = 16
DEFAULT_MAX_CANDIDATES = 160
MIN_LAYERS = 4  # a full layer, the filter layer, the full layer after it and one sparse layer
# the least distance between filter layers, and of the last from the end: the layer after a filter layer
# attends fully, so each needs one more after that to decode sparsely from its selection. Fixed by the
# plan's structure (models.omnikv_config), not a setting: --lookahead only sets the capability table's span
MIN_GAP = 3


class CalibrationError(Exception):
    """Something the user can fix (the text, the flags, the model); the message says what."""


# ---------------------------------------------------------------------------------------------
# Recording


def attention_probs(q: torch.Tensor, keys: torch.Tensor, q_pos: Sequence[int], scale: float) -> torch.Tensor:
    """Per query and head, softmax_j(scale · q_h·k_j) over positions j <= q_pos[i] (0 beyond).

    q [Q, H, D], keys [n, Hkv, D] (positions 0..n-1; head h reads KV head h // (H / Hkv)) -> [Q, H, n] fp32."""
    w, h, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    qg = q.float().view(w, hkv, h // hkv, d)
    scores = torch.einsum("wkgd,nkd->wkgn", qg, keys.float()) * scale  # [Q, Hkv, G, n]
    pos = torch.tensor(list(q_pos), device=q.device)
    causal = torch.arange(n, device=q.device)[None, :] > pos[:, None]
    scores = scores.masked_fill(causal[:, None, None, :], float("-inf"))
    return scores.softmax(dim=-1).reshape(w, h, n)


class RecordingBackend(TorchAttentionBackend):
    """The torch backend, plus a record of every layer's attention for the last `queries` positions of
    a one-request prefill (module docstring, 1.). `keep_layers`: layers whose full probabilities
    [Q, H, n] and queries [Q, H, D] are kept too (for checks; memory Q · H · n each)."""

    mla_normal_on_cpu = True  # MLA's attention is recorded from the per-head q and k of the fresh prefill

    def __init__(self, num_layers: int, queries: int, keep_layers: Iterable[int] = ()) -> None:
        super().__init__()
        self.num_layers, self.queries = num_layers, queries
        self.keep_layers = frozenset(keep_layers)
        self.positions: list[int] = []  # the observation queries' positions
        self.req_pool_idx = -1  # the request's row in req_to_token (its KV stays in the pool after the forward)
        self.max_head: list[torch.Tensor | None] = [None] * num_layers  # [Q, n] fp32, CPU
        self.head_mean: list[torch.Tensor | None] = [None] * num_layers  # [Q, n] fp32, CPU
        self.probs: dict[int, torch.Tensor] = {}  # [Q, H, n] fp32
        self.q: dict[int, torch.Tensor] = {}  # [Q, H, D] as the layer computed them (fp32)
        self.scale: dict[int, float] = {}

    def _record(self, layer_id: int, q: torch.Tensor, keys: torch.Tensor, batch: ForwardBatch, scale: float) -> None:
        """q [T, H, D] of the batch's new tokens, keys [>= seq_len, Hkv, D] of the request's positions."""
        if batch.batch_size != 1:
            raise ValueError("the recording backend records the prefill of one request")
        seq_len, new = batch.seq_lens_cpu[0], batch.extend_seq_lens_cpu[0]
        if new < self.queries:
            raise ValueError(f"the forward has {new} new tokens, fewer than the {self.queries} observation queries")
        positions = list(range(seq_len - self.queries, seq_len))
        qq = q[new - self.queries : new]
        probs = attention_probs(qq, keys[:seq_len], positions, scale)
        self.positions = positions
        self.req_pool_idx = int(batch.req_pool_indices[0])
        self.max_head[layer_id] = probs.amax(dim=1).cpu()
        self.head_mean[layer_id] = probs.mean(dim=1).cpu()
        self.scale[layer_id] = scale
        if layer_id in self.keep_layers:
            self.probs[layer_id] = probs.cpu()
            self.q[layer_id] = qq.detach().float().cpu()

    def forward_extend(self, q, k, v, layer, batch):
        out = super().forward_extend(q, k, v, layer, batch)  # stores k, v in the pool first
        k_buf, _ = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        row = int(batch.req_pool_indices[0])
        slots = batch.req_to_token_pool.req_to_token[row, : batch.seq_lens_cpu[0]].to(torch.int64)
        self._record(layer.layer_id, q, k_buf[slots], batch, layer.scaling)  # the K attention read
        return out

    def forward_mla_normal(self, q, k, v, layer, batch):
        out = super().forward_mla_normal(q, k, v, layer, batch)  # fresh prefill: k covers every position
        self._record(layer.layer_id, q, k, batch, layer.scaling)
        return out

    def missing_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.max_head) if m is None]


def calibration_runner(loaded: LoadedModel, tokens: int, device: str = "cpu") -> ModelRunner:
    """A one-request `ModelRunner` with room for `tokens` positions, on the model's torch forward (native
    CPU weights still compute its linear layers; the recording backend sees every attention)."""
    return ModelRunner(loaded.model, loaded.config, max_total_tokens=tokens + 1, max_running_requests=1,
                       max_context_len=tokens + 1, device=device, disable_cuda_graph=True, native_forward=False)


@torch.no_grad()
def record_prefill(runner: ModelRunner, ids: Sequence[int], queries: int,
                   keep_layers: Iterable[int] = ()) -> RecordingBackend:
    """Prefills `ids` as one request through `runner` with a `RecordingBackend` in place of its
    attention backend; the request's KV stays in the runner's pool (row `recorder.req_pool_idx`) for
    whoever wants to check it."""
    recorder = RecordingBackend(runner.config.num_hidden_layers, queries, keep_layers)
    runner.attn_backend = recorder
    row = runner.req_to_token_pool.alloc()
    if row is None:
        raise RuntimeError("the calibration runner has no free request row")
    runner.forward(runner.build_batch([RequestSlice(row, 0, list(ids))]))
    missing = recorder.missing_layers()
    if missing:
        raise RuntimeError(f"no attention was recorded at layers {missing}")
    return recorder


# ---------------------------------------------------------------------------------------------
# Measuring and choosing


def coverage_matrix(max_head: torch.Tensor, head_mean: torch.Tensor, positions: Sequence[int],
                    rule: OmniKVConfig) -> torch.Tensor:
    """cover [L, L]: cover[l, j] = mean over queries of layer j's head-mean attention mass on the
    tokens `rule` keeps by layer l's max-over-heads importance. max_head, head_mean [L, Q, n]."""
    layers, q, n = max_head.shape
    kept = torch.zeros(layers, q, n, dtype=torch.float32)
    for layer in range(layers):
        for i, p in enumerate(positions):
            ctx = p + 1
            chosen = select_positions(max_head[layer, i, :ctx], rule.budget_for(ctx), rule.sink_tokens,
                                      rule.recent_tokens)
            kept[layer, i, chosen] = 1.0
    return torch.einsum("lqn,jqn->lj", kept, head_mean.float()) / q


def capabilities(cover: torch.Tensor, lookahead: int) -> list[float | None]:
    """capability(l) = mean of cover[l, l+1 .. min(l + lookahead, L - 1)]; None for the last layer.
    Rounded to 4 decimals: the rule compares these numbers (differences below that are noise, and
    rounding keeps the choice the same on every machine and when re-derived from the saved table)."""
    layers = cover.shape[0]
    out: list[float | None] = []
    for layer in range(layers):
        nxt = range(layer + 1, min(layer + lookahead, layers - 1) + 1)
        out.append(round(sum(float(cover[layer, j]) for j in nxt) / len(nxt), 4) if len(nxt) else None)
    return out


def sparse_mass(cover: torch.Tensor, config: OmniKVConfig) -> float | None:
    """What the plan of `config` keeps: the mean over its SPARSE layers j of cover[filter of j, j] (None
    when the plan has no sparse layer). A summary for the user, not part of the rule."""
    plan = config.plan(cover.shape[0])
    kept = [float(cover[config.filter_layers[src], j]) for j, (role, src) in enumerate(zip(plan.roles, plan.source))
            if role == SPARSE]
    return sum(kept) / len(kept) if kept else None


def _check_depth(layers: int) -> None:
    if layers < MIN_LAYERS:
        raise CalibrationError(f"the model has {layers} layers; OmniKV needs at least {MIN_LAYERS} (a full layer, "
                               "the filter layer, the full layer after it and a layer that attends sparsely)")


# ---------------------------------------------------------------------------------------------
# Choosing by decoding (module docstring, 3.)

FACT = " Note: the access key for server {name} is {code}. "
QUESTION = "What is the access key for server {name}? Reply with the number only."
SERVERS = ("orion", "vega", "lyra", "draco", "cygnus", "hydra", "pavo", "corvus", "lepus", "musca", "norma", "carina")
PROBE_SEED = 2025
PROBE_OVERHEAD = 256  # positions kept for the fact, the question and the chat template around the window


def probe_prompts(tokenizer: Any, ids: Sequence[int], probes: int, length: int,
                  seed: int = PROBE_SEED) -> list[list[int]]:
    """The retrieval probes: `probes` windows of `length` tokens of `ids`, spread over it, each with a
    fact at depth (i + 1/2) / probes and the question asking for it after the window."""
    rng = random.Random(seed)
    length = min(length, len(ids))
    out = []
    for i in range(probes):
        name, code = rng.choice(SERVERS), rng.randrange(10000, 100000)
        start = i * (len(ids) - length) // max(probes - 1, 1)
        window = list(ids[start : start + length])
        fact = tokenizer.encode(FACT.format(name=name, code=code), add_special_tokens=False)
        at = int((i + 0.5) / probes * len(window))
        out.append(user_turn_ids(tokenizer, window[:at] + fact + window[at:], QUESTION.format(name=name)))
    return out


class ProbeSet:
    """The probes prefilled once in `runner` (a request row each, full attention), full attention's
    greedy answers and its next-token log-probabilities along them; `score` decodes the same answers
    with OmniKV under a given config over the same prompt KV."""

    def __init__(self, runner: ModelRunner, prompts: Sequence[Sequence[int]], answer_tokens: int) -> None:
        self.runner = runner
        self.steps = answer_tokens
        self.rows: list[int] = []
        self.lens = [len(p) for p in prompts]
        first = []
        for prompt in prompts:
            row = runner.req_to_token_pool.alloc()
            if row is None:
                raise RuntimeError("the probe runner has no free request row")
            self.rows.append(row)
            logits = runner.forward(runner.build_batch([RequestSlice(row, 0, list(prompt))]))
            first.append(int(logits[-1].argmax()))
        self.answers = [[t] for t in first]  # full attention's tokens: the inputs of every decode
        self.reference = self._decode(omnikv=False, extend=True)

    @torch.no_grad()
    def _decode(self, omnikv: bool, extend: bool = False) -> torch.Tensor:
        """Log-probabilities [steps, probes, vocab] of `steps` decode steps fed the answers (greedy ones
        appended when `extend`); the decoded tokens' slots are freed again, the prompts' stay."""
        r = self.runner
        out = []
        for i in range(self.steps):
            batch = r.build_batch([RequestSlice(row, n + i, [ans[i]], omnikv=omnikv)
                                   for row, n, ans in zip(self.rows, self.lens, self.answers)])
            logp = r.forward(batch).float().log_softmax(-1)
            out.append(logp)
            if extend:
                for ans, x in zip(self.answers, logp.argmax(-1).tolist()):
                    ans.append(int(x))
        table = r.req_to_token_pool.req_to_token
        for row, n in zip(self.rows, self.lens):
            r.allocator.free(table[row, n : n + self.steps].to(torch.int64))
        return torch.stack(out)

    def score(self, config: OmniKVConfig) -> tuple[float, float]:
        """(mean KL(full || OmniKV), share of steps whose greedy token is full attention's) under `config`."""
        self.runner.set_omnikv(config)
        logp = self._decode(omnikv=True)
        ref = self.reference
        kl = (ref.exp() * (ref - logp)).sum(-1)
        agree = (logp.argmax(-1) == ref.argmax(-1)).float().mean()
        return float(kl.mean()), float(agree)


def _check_first(first: int, layers: int) -> None:
    _check_depth(layers)
    if not 1 <= first <= layers - MIN_GAP:
        raise CalibrationError(f"--first-filter {first} must be between 1 and {layers - MIN_GAP} for a model of "
                               f"{layers} layers (the layer after a filter layer attends fully, and a layer after "
                               "that must be left to decode sparsely)")


def placements(layers: int, first: int, filters: int, gap: int = MIN_GAP, stride: int = 1) -> list[tuple[int, ...]]:
    """Filter-layer tuples starting at `first`, each next at least `gap` after the previous and the last
    at most L - MIN_GAP; the later ones on every `stride`-th layer from first + gap."""
    later = range(first + gap, layers - MIN_GAP + 1, stride)
    return [(first, *rest) for rest in itertools.combinations(later, filters - 1)
            if all(b - a >= gap for a, b in zip((first, *rest), rest))]


def search_filter_layers(score: Callable[[tuple[int, ...]], float], layers: int, first: int, filters: int,
                         max_candidates: int) -> tuple[tuple[int, ...], dict[tuple[int, ...], float]]:
    """The placement of lowest score (module docstring, 3.) and every score computed. Takes the most
    filter layers (up to `filters`) that fit after `first`."""
    _check_first(first, layers)
    m = filters
    while m > 1 and not placements(layers, first, m):
        m -= 1
    stride = 1
    while len(placements(layers, first, m, stride=stride)) > max_candidates:
        stride += 1
    scores: dict[tuple[int, ...], float] = {}

    def rank(c: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        if c not in scores:
            scores[c] = round(score(c), 6)  # the table's precision: the choice does not hang on float noise
        return scores[c], c

    best = min(placements(layers, first, m, stride=stride), key=rank)
    allowed = set(placements(layers, first, m))
    while stride > 1:  # refine: one filter layer moved by fewer than `stride` layers, while it improves
        moves = [best[:i] + (best[i] + d,) + best[i + 1:] for i in range(1, m) for d in range(1 - stride, stride) if d]
        nxt = min([c for c in moves if c in allowed] + [best], key=rank)
        if nxt == best:
            break
        best = nxt
    return best, scores


@dataclass
class Calibration:
    config: OmniKVConfig
    capability: list[float | None]
    own_mass: list[float]
    cover: torch.Tensor  # [L, L]
    sparse_mass: float | None  # mean over the plan's sparse layers of the mass the table says their selection holds
    scores: dict[tuple[int, ...], float]  # every placement scored: mean KL(full || OmniKV) on the probes
    agreement: float  # the chosen plan's greedy agreement with full attention on the probes
    recorder: RecordingBackend


def _check_probe_memory(loaded: LoadedModel, slots: int, probes: int, answer_tokens: int, device: str) -> None:
    """CalibrationError unless the probes' KV cache and their log-probabilities (full attention's and one
    placement's, [answer tokens, probes, vocab] in fp32 each) fit in the memory free now: `--probes` is
    the user's, and 100,000 of them used to ask torch for 45 GB after the recording prefill had run."""
    from engine.core import available_memory, kv_bytes_per_token

    dtype = next(loaded.model.parameters()).dtype
    kv = slots * kv_bytes_per_token(loaded.config, dtype if dtype.is_floating_point else torch.float32)
    logprobs = 2 * answer_tokens * probes * loaded.config.vocab_size * 4
    free = available_memory(torch.device(device))
    if kv + logprobs > 0.9 * free:
        raise CalibrationError(f"{probes} probes of up to {slots // probes} tokens need ~{(kv + logprobs) / 2**30:.1f} "
                               f"GiB ({kv / 2**30:.1f} of KV cache, {logprobs / 2**30:.1f} of log-probabilities), "
                               f"more than the {free / 2**30:.1f} GiB free; lower --probes, --probe-tokens or "
                               "--answer-tokens")


def _check_finite(what: str, values: Sequence[float]) -> None:
    """A model whose activations overflow gives NaN coverages and KLs, from which nothing can be chosen (the
    config written held a bare NaN, which strict JSON parsers refuse): refused, saying so."""
    if not all(math.isfinite(v) for v in values):
        raise CalibrationError(f"the model's {what} on this text are not finite numbers (NaN or infinity): its weights "
                               "or activations overflow, so no filter layer can be chosen; check the model's output "
                               "with `mlaserve generate`")


def calibrate(loaded: LoadedModel, ids: Sequence[int], *, queries: int = DEFAULT_QUERIES,
              lookahead: int = DEFAULT_LOOKAHEAD, filters: int = MAX_FILTER_LAYERS, budget_ratio: float = 0.1,
              first_filter: int | None = None, probes: int = DEFAULT_PROBES, probe_tokens: int = DEFAULT_PROBE_TOKENS,
              answer_tokens: int = DEFAULT_ANSWER_TOKENS, max_candidates: int = DEFAULT_MAX_CANDIDATES,
              device: str = "cpu", model_name: str = "", text_name: str = "",
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Records, measures and chooses (module docstring); the config carries the table in `calibration`."""
    layers = loaded.config.num_hidden_layers
    _check_depth(layers)  # before the prefill
    first = first_filter_default(layers) if first_filter is None else first_filter
    _check_first(first, layers)
    if not 1 <= queries < len(ids):
        raise CalibrationError(f"--queries {queries} must be at least 1 and below the {len(ids)} tokens calibrated on")
    # the fact, the question and the chat template take some positions, the answer `answer_tokens` more
    room = loaded.config.max_position_embeddings - answer_tokens - PROBE_OVERHEAD
    if room < MIN_TOKENS // 2:
        raise CalibrationError(f"the model's context ({loaded.config.max_position_embeddings} tokens) leaves no room "
                               f"for probes with {answer_tokens} answer tokens; lower --answer-tokens")
    _check_probe_memory(loaded, probes * (min(probe_tokens, room, len(ids)) + PROBE_OVERHEAD + answer_tokens), probes,
                        answer_tokens, device)  # before the prefill, with the probes' largest size
    say = progress or (lambda _: None)
    rule = OmniKVConfig(filter_layers=(0,), budget_ratio=budget_ratio)  # its sink/recent/budget: the defaults
    prompts = probe_prompts(loaded.tokenizer, ids, probes, min(probe_tokens, room))
    shortest = min(len(p) for p in prompts)
    if not rule.is_sparse_for(shortest):  # every placement would keep every token: a tie at KL 0, chosen blindly
        need = next((c for c in range(shortest, 1 << 24) if rule.is_sparse_for(c)), None)
        if need is None:
            raise CalibrationError(f"--budget-ratio {budget_ratio:g} keeps every token of any context OmniKV serves: "
                                   "no placement could lose anything; lower it (0.1 by default)")
        raise CalibrationError(
            f"the retrieval probes are {shortest} tokens, and OmniKV keeps every token of a context that short (the "
            f"{rule.sink_tokens} first, the {rule.recent_tokens} recent and {budget_ratio:g} of the context): no "
            f"placement could lose anything; a probe needs more than {need - 1} tokens: --probe-tokens "
            f"{need - shortest + min(probe_tokens, room, len(ids))} or more (and a text at least that long)")
    runner = calibration_runner(loaded, len(ids), device)
    try:
        rec = record_prefill(runner, ids, queries)
    finally:
        runner.close()
    cover = coverage_matrix(torch.stack(rec.max_head), torch.stack(rec.head_mean), rec.positions, rule)
    capability = capabilities(cover, lookahead)
    own = [float(cover[i, i]) for i in range(layers)]
    _check_finite("attention", [x for x in (*capability, *own) if x is not None])

    slots = sum(len(p) for p in prompts) + probes * answer_tokens
    longest = max(len(p) for p in prompts) + answer_tokens
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=slots + 1, max_running_requests=probes,
                         max_context_len=longest + 1, device=device, disable_cuda_graph=True,
                         omnikv=dataclasses.replace(rule, filter_layers=(first,)))
    try:
        say(f"prefilling {probes} retrieval probes of {max(len(p) for p in prompts)} tokens, full attention answering "
            f"{answer_tokens} tokens each")
        probe_set = ProbeSet(runner, prompts, answer_tokens)
        agreement: dict[tuple[int, ...], float] = {}

        def score(layers_: tuple[int, ...]) -> float:
            kl, agree = probe_set.score(dataclasses.replace(rule, filter_layers=layers_))
            agreement[layers_] = agree
            say(f"filter layers {list(layers_)}: KL {kl:.4f}, greedy agreement {agree:.1%}")
            return kl

        chosen, scores = search_filter_layers(score, layers, first, filters, max_candidates)
    finally:
        runner.close()
    _check_finite("answers' log-probabilities", list(scores.values()))
    kept = sparse_mass(cover, OmniKVConfig(filter_layers=chosen))
    ranked = sorted(scores, key=lambda c: (scores[c], c))
    calibration = {
        "model": model_name, "text": text_name, "tokens": len(ids), "queries": queries, "lookahead": lookahead,
        "capability": capability,
        "own_mass": [round(x, 4) for x in own],
        "sparse_mass": None if kept is None else round(kept, 4),
        "first_filter": first, "probes": probes, "probe_tokens": max(len(p) for p in prompts),
        "answer_tokens": answer_tokens, "candidates": len(scores),
        "best": [{"filter_layers": list(c), "kl": scores[c], "agreement": round(agreement[c], 4)} for c in ranked[:5]],
    }
    config = dataclasses.replace(rule, filter_layers=chosen, calibration=calibration)
    return Calibration(config, capability, own, cover, kept, scores, agreement[chosen], rec)


def format_table(capability: Sequence[float | None], own_mass: Sequence[float], chosen: Iterable[int]) -> list[str]:
    """A header, then one line per layer: layer, capability, own mass, and `filter` on the chosen ones."""
    picked = set(chosen)
    lines = ["layer  capability  own_mass"]
    for layer, (c, o) in enumerate(zip(capability, own_mass)):
        cap = "         -" if c is None else f"{c:10.4f}"
        lines.append(f"{layer:5d}  {cap}  {o:8.4f}" + ("  filter" if layer in picked else ""))
    return lines


def format_ranking(best: Sequence[dict[str, Any]]) -> list[str]:
    """A header, then the best placements scored on the probes, best first (the first is the choice)."""
    lines = ["filter_layers   kl_on_probes  agreement"]
    for b in best:
        lines.append(f"{','.join(str(x) for x in b['filter_layers']):<14}  {b['kl']:12.6f}  {b['agreement']:9.4f}")
    return lines


# ---------------------------------------------------------------------------------------------
# The command


def _device(text: str) -> str:
    from engine.args import device_name

    problem = device_name(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Measure how well each layer's attention predicts the next layers' (OmniKV's filter "
                    "capability) over a text, print the table, and write an OmniKV config with the chosen "
                    "filter layers. See mlaserve/calibrate_omnikv.py for the definitions and the rule.")
    p.add_argument("--model", required=True, metavar="MODEL", help="built-in model name, HF directory or .gguf file")
    p.add_argument("--text", required=True, metavar="FILE",
                   help=f"UTF-8 text to calibrate on (at least {MIN_TOKENS} tokens; natural text or code "
                        "of the kind the model will serve)")
    p.add_argument("--output", metavar="CONFIG.json",
                   help="where to write the config (default: omnikv-<model>.json in the current directory, "
                        "<model> the built-in name or the checkpoint's file/directory name)")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"tokens of the text to prefill at most (default: {DEFAULT_TOKENS}, capped by the "
                        "model's context)")
    p.add_argument("--queries", type=positive_int, default=DEFAULT_QUERIES, metavar="Q",
                   help=f"observation queries: the last Q positions (default: {DEFAULT_QUERIES})")
    p.add_argument("--lookahead", type=positive_int, default=DEFAULT_LOOKAHEAD, metavar="n",
                   help=f"following layers a layer's capability is measured over, in the printed table (default: "
                        f"{DEFAULT_LOOKAHEAD}); the choice is made by decoding, with filter layers at least "
                        f"{MIN_GAP} apart whatever n is")
    p.add_argument("--filters", type=int, choices=range(1, MAX_FILTER_LAYERS + 1), default=MAX_FILTER_LAYERS,
                   metavar="m", help=f"filter layers to choose, 1 to {MAX_FILTER_LAYERS} (default: {MAX_FILTER_LAYERS})")
    p.add_argument("--budget-ratio", type=float_in(0.0, 1.0, low_open=True, high_open=True), default=0.1, metavar="R",
                   help="share of the context selected by importance, in (0, 1) (default: 0.1; 1 would keep every "
                        "token, with nothing to choose); written to the config")
    p.add_argument("--first-filter", type=positive_int, default=None, metavar="LAYER",
                   help="the first filter layer: every layer before it attends fully, so it sets the decode cost "
                        "(default: a fifth of the depth); the others are chosen by decoding")
    p.add_argument("--probes", type=positive_int, default=DEFAULT_PROBES, metavar="R",
                   help=f"retrieval probes made from the text to score placements on (default: {DEFAULT_PROBES})")
    p.add_argument("--probe-tokens", type=positive_int, default=DEFAULT_PROBE_TOKENS, metavar="C",
                   help=f"tokens of the text in each probe (default: {DEFAULT_PROBE_TOKENS}, at most the text)")
    p.add_argument("--answer-tokens", type=positive_int, default=DEFAULT_ANSWER_TOKENS, metavar="G",
                   help=f"answer tokens decoded per probe and placement (default: {DEFAULT_ANSWER_TOKENS})")
    p.add_argument("--max-candidates", type=positive_int, default=DEFAULT_MAX_CANDIDATES, metavar="N",
                   help="placements scored before a coarser grid and a local refinement take over "
                        f"(default: {DEFAULT_MAX_CANDIDATES})")
    p.add_argument("--device", type=_device, default="cpu", metavar="DEVICE", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weights and activations dtype (default: float32; the probabilities are fp32 anyway)")
    return p


def calibration_weights(args: argparse.Namespace) -> str | None:
    """On the CPU the weights go to the native kernels as the file stores them (as `mlaserve serve` runs
    them by default): the recording prefill's linear layers run there, and the probes' decoding runs the
    whole native forward (many times faster than torch ops on a CPU). Elsewhere torch weights."""
    return "file" if args.device.startswith("cpu") else None


MAX_TEXT_BYTES = 64 << 20  # calibration reads a sample; far more than it tokenizes


def read_text(path: str) -> str:
    try:
        file = user_path(path)
        problem = unreadable_file(file, MAX_TEXT_BYTES)
        if problem:
            raise CalibrationError(f"the text file {path} {problem}; pass --text a UTF-8 text file (a sample will do)")
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(f"the text file {path} does not exist; pass --text a UTF-8 text file") from None
    except UnicodeDecodeError as err:
        raise CalibrationError(f"the text file {path} is not UTF-8 (byte {err.start}); convert it, e.g. with "
                               "iconv -t UTF-8") from None
    except OSError as err:
        raise CalibrationError(f"cannot read the text file {path}: {err.strerror or err}") from None


def leading_ids(tokenizer: Any, text: str, count: int) -> list[int]:
    """The first `count` token ids of `text` (all of them if it has fewer), tokenizing only a prefix of it,
    grown until it holds `count` tokens and a margin (the cut may split the last word): tokenizing a 64 MiB
    text took 9 GB, for a calibration that uses at most a few thousand tokens."""
    chars = 8 * (count + MARGIN_TOKENS)
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text) or len(ids) >= count + MARGIN_TOKENS:
            return ids[:count]
        chars *= 4


MARGIN_TOKENS = 64  # tokens past those used, so that none of them comes from a word the prefix's end cut


def fit_note(fit: int, wanted: int, first: int, layers: int) -> str:
    """Why fewer filter layers than --filters were chosen: the rule of `placements`."""
    return (f"only {fit} of {wanted} filter layers fit after layer {first} in {layers} layers (each at least "
            f"{MIN_GAP} layers after the previous, the last at most layer {layers - MIN_GAP})"
            + ("; a lower --first-filter leaves room for more" if first > 1 else ""))


def output_problem(output: Path, given: bool = True) -> str | None:
    """Why the config could not be written to `output` (checked before the run, which takes minutes), or
    None. `given`: by --output (else the default name, in the current directory)."""
    shown = f"--output {output}" if given else f"the default output {output} (in the current directory, {Path.cwd()})"
    if output.is_dir():
        return f"{shown} is a directory: give a file path, e.g. {output / 'omnikv.json'}"
    parent = output.absolute().parent
    if not parent.exists():
        return f"{shown}: the directory {parent} does not exist; create it or pass --output a path in an existing one"
    if not parent.is_dir():
        return f"{shown}: {parent} is not a directory; pass --output a path in a directory"
    if output.exists() and not os.access(output, os.W_OK):
        return f"{shown} is not writable (permission denied); pass --output a writable path"
    if output.is_file() and output.stat().st_size and not _is_config(output):  # (the --text file itself, say)
        return f"{shown} holds a file that is not an OmniKV config, which writing would replace; pass another path"
    if not output.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"{shown}: cannot create a file in {parent} (permission denied); pass --output a writable path"
    try:  # what access() cannot tell: root passes it where the file system still refuses (/proc, read-only mounts)
        if output.exists():
            with open(output, "ab"):
                pass
        else:
            with open(output, "xb"):
                pass
            output.unlink()
    except OSError as err:
        return f"{shown} cannot be written ({err.strerror or err}); pass --output a writable path"
    return None


def _is_config(path: Path) -> bool:
    """Whether `path` holds an OmniKV config (a JSON object with `filter_layers`): one a run may replace."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "filter_layers" in data


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)  # as argparse and the other commands say it
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    for flag, value in (("--text", args.text), ("--output", args.output)):
        if value == "":
            return _fail(f"{flag} is empty: give a file path")
    try:
        text = read_text(args.text)
    except CalibrationError as err:
        return _fail(str(err))
    name = model_label(args.model)
    output = user_path(args.output) if args.output else Path(f"omnikv-{name}.json")
    problem = output_problem(output, given=bool(args.output))  # now, not after the run
    if problem:
        return _fail(problem)

    try:
        loaded = load_model_checked(args.model, device=args.device, dtype=args.dtype,
                                    cpu_weights=calibration_weights(args), progress=sys.stderr.isatty())
    except BadSetting as err:
        return _fail(str(err))
    try:
        layers = loaded.config.num_hidden_layers  # checked before tokenizing and prefilling anything
        _check_first(first_filter_default(layers) if args.first_filter is None else args.first_filter, layers)
    except CalibrationError as err:
        return _fail(str(err))
    tok = loaded.tokenizer
    if tok is None:
        return _fail(f"the model {args.model} has no tokenizer")
    limit = min(args.max_tokens, loaded.config.max_position_embeddings)
    if limit < MIN_TOKENS:
        return _fail(f"--max-tokens {args.max_tokens} (the model's context: {loaded.config.max_position_embeddings}) "
                     f"leaves fewer than the {MIN_TOKENS} tokens calibration needs")
    ids = leading_ids(tok, text, limit)
    if len(ids) < MIN_TOKENS:
        return _fail(f"the text {args.text} has {len(ids)} tokens for this model; calibration needs at least "
                     f"{MIN_TOKENS}: give a longer text")
    print(f"{PROG}: prefilling {len(ids)} tokens through {loaded.config.num_hidden_layers} layers", file=sys.stderr)
    try:
        result = calibrate(loaded, ids, queries=args.queries, lookahead=args.lookahead, filters=args.filters,
                           budget_ratio=args.budget_ratio, first_filter=args.first_filter, probes=args.probes,
                           probe_tokens=args.probe_tokens, answer_tokens=args.answer_tokens,
                           max_candidates=args.max_candidates, device=args.device,
                           model_name=name, text_name=Path(args.text).name,
                           progress=lambda line: print(f"{PROG}: {line}", file=sys.stderr, flush=True))
    except CalibrationError as err:
        return _fail(str(err))
    chosen = result.config.filter_layers
    print("\n".join(format_table(result.capability, result.own_mass, chosen)))
    print()
    print("\n".join(format_ranking(result.config.calibration["best"])))
    try:
        result.config.save(output)
    except OSError as err:
        return _fail(f"cannot write {output}: {err.strerror or err}; pass --output a writable path")
    if len(chosen) < args.filters:
        print(f"{PROG}: {fit_note(len(chosen), args.filters, chosen[0], loaded.config.num_hidden_layers)}",
              file=sys.stderr)
    plan = result.config.plan(loaded.config.num_hidden_layers)
    sparse = sum(1 for r in plan.roles if r == SPARSE)
    kept = "" if result.sparse_mass is None else f", keeping {result.sparse_mass:.1%} of their attention mass"
    print(f"{PROG}: filter layers {list(chosen)}: {sparse} of {len(plan.roles)} layers decode sparsely{kept}; "
          f"on the probes KL {result.scores[chosen]:.4f} and {result.agreement:.1%} greedy agreement with full "
          f"attention; written to {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
