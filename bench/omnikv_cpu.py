"""OmniKV on the CPU with the default model (SmolLM2-135M, GGUF Q4_1, the native forward): decode
speed against full attention, fidelity on long real text, and needle-in-a-haystack — full attention
and OmniKV in the same run, on the same prompt KV (one prefill, two request rows sharing it).

Text: the Python documentation shipped with the interpreter (`pydoc_data.topics`), so nothing is
downloaded. Config: the model's calibrated OmniKV config (configs/omnikv/, else the uncalibrated
default) with the budget set by `--budget` (default 10% of the context). Activations and KV cache in
fp32 by default; `--dtype auto` runs them as `mlaserve serve` does (bf16 on a CPU with bf16 math, and a
bf16 cache for the GGUF blocks).

- speed: decode step time at contexts 1K..8K, full vs OmniKV rounds interleaved, medians;
- fidelity: greedy decode of 256 tokens with full attention; OmniKV fed the same tokens (teacher
  forcing) predicts each next token: the share of positions where its greedy choice is full
  attention's. Also the free-running identical prefix (both generate on their own);
- needle: a five-digit passcode sentence inserted at 10 depths of a haystack of 1K, 2K, 4K and 8K
  tokens, the question asked through the chat template; does OmniKV give the same answer (the number
  in its reply) as full attention (and how often each is right; identical wording is reported too);
- divergence: the needle prompts of each of `--divergence-seeds`, each answered greedily by full attention with
  OmniKV fed the same tokens: per step KL(full || OmniKV) of the next-token distributions, whether the
  greedy choices differ, and full attention's margin between its first two choices there. The needle
  part's yes/no answers hinge on near-ties where full attention makes a number up; this measures
  how far the distributions move, so that configs can be compared on a continuous scale.

- floor: how far changes nobody calls a fault move the same measures: the needle prompts of
  `--divergence-seeds` and `--floor-doc-prompts` documentation prompts, run in fp32 (the reference) and
  as served (a bf16 KV cache), each with full attention and OmniKV, and by llama.cpp on the same GGUF
  (full attention; skipped where llama-cpp-python is absent); each answers freely and is fed fp32 full
  attention's tokens: needle answers, and per-step KL and greedy choice against fp32 full attention.

    .venv/bin/python bench/omnikv_cpu.py [--parts speed,fidelity,needle,divergence,floor] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_common import machine_info, machine_tag, percentile, versions, write_json  # noqa: E402
from mlaserve.argtypes import positive_int  # noqa: E402
from engine.process import freeze_gc_heap  # noqa: E402
from server.chat_template import user_turn_ids  # noqa: E402

MAX_CTX = 8192


def doc_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


class Harness:
    """One model runner with OmniKV planned; requests share a prompt's KV like the prefix cache does."""

    def __init__(self, model: str, budget: float, dtype: str = "float32", **overrides: Any) -> None:
        """`dtype`: the activations' (float32; or auto, as `mlaserve serve` resolves it: bf16 where the CPU
        does bf16 math), the KV cache's as `--kv-dtype auto` makes it for that (bf16 for GGUF blocks
        whatever the activations)."""
        import dataclasses

        from executor.cpu_forward import auto_kv_dtype
        from executor.model_runner import ModelRunner
        from models.loader.load import load_model
        from models.omnikv_config import OmniKVConfig

        loaded = load_model(model, dtype=dtype, cpu_weights="file", progress=False)
        base, self.origin = OmniKVConfig.for_model(model, loaded.config.num_hidden_layers)
        self.cfg = dataclasses.replace(base, budget_ratio=budget, budget_tokens=None, **overrides)
        self.tok = loaded.tokenizer
        self.dtype, self.kv_dtype = loaded.dtype, auto_kv_dtype(loaded.model, loaded.dtype) if dtype == "auto" \
            else loaded.dtype
        self.runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=3 * MAX_CTX, max_running_requests=4,
                                  max_context_len=MAX_CTX, kv_dtype=self.kv_dtype, omnikv=self.cfg)
        if self.runner.native_forward is None:
            raise RuntimeError(f"the native forward is off: {self.runner.native_off_reason}")
        torch.set_num_threads(1)  # sampling only: the native pool has the cores

    def prefill(self, ids: list[int]) -> tuple[int, int]:
        """A row holding the prompt's KV, and the greedy first token."""
        from executor.model_runner import RequestSlice

        r = self.runner
        row = r.req_to_token_pool.alloc()
        for start in range(0, len(ids), 2048):
            logits = r.forward(r.build_batch([RequestSlice(row, start, ids[start : start + 2048])]))
        return row, int(logits[-1].argmax())

    def fork(self, row: int, n: int) -> int:
        """A second row reading the first row's n prompt slots (its own tokens get their own slots)."""
        r = self.runner
        other = r.req_to_token_pool.alloc()
        r.req_to_token_pool.write(other, 0, r.req_to_token_pool.req_to_token[row, :n])
        return other

    def logits(self, rows: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One decode forward: (row, context length, input token, omnikv) each -> fp32 logits [rows, V]."""
        from executor.model_runner import RequestSlice

        r = self.runner
        return r.forward(r.build_batch([RequestSlice(row, n, [tok], omnikv=o) for row, n, tok, o in rows])).float()

    def step(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """One decode forward -> greedy next tokens."""
        return [int(x) for x in self.logits(rows).argmax(-1)]

    def release(self, rows: list[int], shared: int, lengths: list[int]) -> None:
        """Frees the shared prompt slots once and each row's own slots."""
        r = self.runner
        table = r.req_to_token_pool.req_to_token
        r.allocator.free(table[rows[0], :shared].to(torch.int64))
        for row, n in zip(rows, lengths):
            r.allocator.free(table[row, shared:n].to(torch.int64))
            r.req_to_token_pool.free(row)


def speed(h: Harness, ids: list[int], contexts: list[int], steps: int, rounds: int) -> list[dict[str, Any]]:
    out = []
    for ctx in contexts:
        prompt = ids[:ctx]
        a, tok = h.prefill(prompt)
        b = h.fork(a, ctx)
        n = {a: ctx, b: ctx}
        last = {a: tok, b: tok}
        times: dict[bool, list[float]] = {False: [], True: []}
        for rnd in range(rounds):
            for sparse in ((False, True) if rnd % 2 == 0 else (True, False)):
                row = b if sparse else a
                t0 = time.perf_counter()
                for _ in range(steps):
                    last[row] = h.step([(row, n[row], last[row], sparse)])[0]
                    n[row] += 1
                times[sparse].append((time.perf_counter() - t0) / steps)
        h.release([a, b], ctx, [n[a], n[b]])
        full, sparse = statistics.median(times[False]), statistics.median(times[True])
        out.append({"context": ctx, "full_ms": round(full * 1e3, 2), "omnikv_ms": round(sparse * 1e3, 2),
                    "speedup": round(full / sparse, 3), "rounds": rounds, "steps_per_round": steps})
        print(f"speed  ctx {ctx:5d}: full {full * 1e3:7.2f} ms/token, OmniKV {sparse * 1e3:7.2f} ms/token, "
              f"x{full / sparse:.2f}", flush=True)
    return out


def doc_prompts(h: Harness, ids: list[int], ctx: int, prompts: int, gen: int) -> Iterator[list[int]]:
    """`prompts` chat prompts of ~`ctx` tokens, each a stretch of the documentation of its own (spread
    over it) with a request to summarize, leaving room for `gen` generated tokens."""
    question = "Summarize the documentation above in your own words."
    for k in range(prompts):
        start = k * (len(ids) - ctx) // max(prompts, 1)
        yield user_turn_ids(h.tok, ids[start : start + ctx - gen - 64], question)[: MAX_CTX - gen - 1]


def fidelity(h: Harness, ids: list[int], contexts: list[int], prompts: int, gen: int) -> list[dict[str, Any]]:
    out = []
    for ctx in contexts:
        for prompt in doc_prompts(h, ids, ctx, prompts, gen):
            a, tok = h.prefill(prompt)
            b, c = h.fork(a, len(prompt)), h.fork(a, len(prompt))
            full, forced, free = [tok], [tok], [tok]
            n = len(prompt)
            for i in range(gen - 1):
                nxt = h.step([(a, n + i, full[-1], False), (b, n + i, full[-1], True), (c, n + i, free[-1], True)])
                full.append(nxt[0])
                forced.append(nxt[1])
                free.append(nxt[2])
            agree = sum(x == y for x, y in zip(full[1:], forced[1:])) / (gen - 1)
            prefix = next((i for i, (x, y) in enumerate(zip(full, free)) if x != y), gen)
            h.release([a, b, c], n, [n + gen - 1] * 3)
            out.append({"context": len(prompt), "tokens": gen, "teacher_forced_agreement": round(agree, 4),
                        "free_running_identical_prefix": prefix})
            print(f"fidelity ctx {len(prompt):5d}: agreement {agree:.2%}, identical prefix {prefix}/{gen}", flush=True)
    return out


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two log-probability vectors."""
    return float((p.exp() * (p - q)).sum())


def until_eos(tokens: list[int], stop: set[int]) -> list[int]:
    """`tokens` up to the first end-of-sequence token."""
    return tokens[: next((i for i, x in enumerate(tokens) if x in stop), len(tokens))]


def answer(text: str) -> str | None:
    """The number a needle answer gives (the first run of digits), or None: the answer compared, since
    the model words it freely ("The passcode is 52817." / "The secret passcode mentioned ... is 52817")."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def needle_prompts(h: Harness, ids: list[int], lengths: list[int], depths: int,
                   seed: int) -> Iterator[tuple[int, int, list[int]]]:
    """(depth index, passcode, prompt ids) of every needle prompt: a passcode drawn from `seed` for
    each (length, depth), the haystack cut from the documentation at a place of its own per depth."""
    rng = random.Random(seed)
    question = "What is the secret passcode mentioned in the text above? Answer with the number only."
    for length in lengths:
        for d in range(depths):
            code = rng.randrange(10000, 100000)
            needle_ids = h.tok.encode(f" The secret passcode is {code}. Remember it. ", add_special_tokens=False)
            hay = ids[d * 997 % 20000 :][: length - len(needle_ids) - 64]
            at = round(d / (depths - 1) * len(hay)) if depths > 1 else 0
            yield d, code, user_turn_ids(h.tok, hay[:at] + needle_ids + hay[at:], question)


def needle(h: Harness, ids: list[int], lengths: list[int], depths: int, answer_tokens: int,
           seed: int) -> list[dict[str, Any]]:
    out = []
    stop = set(h.tok.eos_token_ids)
    for d, code, prompt in needle_prompts(h, ids, lengths, depths, seed):
        a, tok = h.prefill(prompt)
        b = h.fork(a, len(prompt))
        full, sparse = [tok], [tok]
        n = len(prompt)
        for i in range(answer_tokens - 1):
            nxt = h.step([(a, n + i, full[-1], False), (b, n + i, sparse[-1], True)])
            full.append(nxt[0])
            sparse.append(nxt[1])
        h.release([a, b], n, [n + answer_tokens - 1] * 2)
        full_text, sparse_text = (h.tok.decode(until_eos(t, stop)).strip() for t in (full, sparse))
        full_ans, sparse_ans = answer(full_text), answer(sparse_text)
        out.append({"length": len(prompt), "depth": round(d / max(depths - 1, 1), 3), "code": code,
                    "full": full_text, "omnikv": sparse_text, "full_answer": full_ans, "omnikv_answer": sparse_ans,
                    "same": full_ans == sparse_ans, "same_text": full_text == sparse_text,
                    "full_correct": full_ans == str(code), "omnikv_correct": sparse_ans == str(code)})
        print(f"needle len {len(prompt):5d} depth {d}: full {full_text!r} omnikv {sparse_text!r}", flush=True)
    return out


def divergence(h: Harness, ids: list[int], lengths: list[int], depths: int, steps: int,
               seeds: list[int]) -> dict[str, Any]:
    """Teacher-forced on full attention's greedy answer for `steps` decode steps after the first answer
    token: per step KL(full || OmniKV), argmax flips, and full attention's top-2 margin (nats) at each flip."""
    kls: list[float] = []
    flips: list[dict[str, Any]] = []
    for seed in seeds:
        for d, _code, prompt in needle_prompts(h, ids, lengths, depths, seed):
            a, tok = h.prefill(prompt)
            b = h.fork(a, len(prompt))
            n, last = len(prompt), tok
            for i in range(steps):
                lg = h.logits([(a, n + i, last, False), (b, n + i, last, True)]).log_softmax(-1)
                full, sparse = lg[0], lg[1]
                kls.append(kl(full, sparse))
                top = full.topk(2)
                if int(sparse.argmax()) != int(top.indices[0]):
                    flips.append({"seed": seed, "length": len(prompt), "depth": d, "step": i,
                                  "margin": round(float(top.values[0] - top.values[1]), 4), "kl": round(kls[-1], 5)})
                last = int(top.indices[0])
            h.release([a, b], n, [n + steps] * 2)
        print(f"divergence seed {seed}: {len(kls)} steps, {len(flips)} flips so far", flush=True)
    pick = lambda q: round(percentile(kls, q), 5)  # noqa: E731
    return {"seeds": seeds, "steps": len(kls), "mean_kl": round(statistics.mean(kls), 5), "p50_kl": pick(50),
            "p90_kl": pick(90), "p99_kl": pick(99), "max_kl": round(max(kls), 4), "flip_rate": round(len(flips) / len(kls), 4),
            "flips": flips}


def floor_llama(path: str, items: list[dict[str, Any]], ref: dict[tuple, list[torch.Tensor]],
                ref_tokens: dict[tuple, list[int]], threads: int) -> dict[tuple, dict[str, Any]]:
    """llama.cpp (llama-cpp-python, its defaults: an f16 KV cache) on the same GGUF and prompt tokens, full
    attention: each needle prompt answered greedily, then fed the reference's tokens; the same per-step
    measures as `floor_pass` for its full attention."""
    import numpy as np

    from bench import peers

    llm = peers.open_llama(path, extra_buffers=peers.extra_buffers(), n_ctx=MAX_CTX, n_threads=threads,
                           n_threads_batch=threads, n_batch=512, logits_all=False, verbose=False)
    logits = lambda: torch.from_numpy(  # noqa: E731
        np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()).log_softmax(-1)
    stop = {llm.token_eos()}
    out: dict[tuple, dict[str, Any]] = {}
    for it in items:
        key, prompt, free_steps, forced_steps = it["key"], it["prompt"], it["free_steps"], it["forced_steps"]
        llm.reset()
        llm.eval(prompt)
        n = len(prompt)
        free = [int(logits().argmax())]
        for _ in range(free_steps):
            llm.eval([free[-1]])
            free.append(int(logits().argmax()))
        llm.n_tokens = n  # the next eval drops the cache past the prompt
        stats: dict[str, list] = {"kl_full": [], "flip_full": []}
        for i in range(forced_steps):
            llm.eval([ref_tokens[key][i]])
            mine, want = logits(), ref[key][i]
            stats["kl_full"].append(kl(want, mine))
            stats["flip_full"].append(int(mine.argmax()) != int(want.argmax()))
        text = llm.detokenize(until_eos(free[: free_steps + 1], stop)).decode("utf-8", "replace").strip()
        out[key] = {"texts": {"full": text}, "answers": {"full": answer(text)}, "code": it.get("code"), **stats}
    return out


def floor_pass(h: Harness, items: list[dict[str, Any]], ref: dict[tuple, list[torch.Tensor]] | None,
               ref_tokens: dict[tuple, list[int]]) -> tuple[dict[tuple, dict[str, Any]], dict[tuple, list[torch.Tensor]]]:
    """One harness over the floor's prompts: each answered freely by full attention and by OmniKV, and
    both fed the reference's tokens (`ref_tokens`; the reference run, `ref` None, feeds its own full
    attention's). Returns per prompt the free answers and, per forced step, KL(reference || run) and
    whether the greedy choice differs, for full attention and OmniKV, plus KL(full || OmniKV) within the
    run; the reference run also returns its full attention's log-probabilities per forced step."""
    stop = set(h.tok.eos_token_ids)
    out: dict[tuple, dict[str, Any]] = {}
    logs: dict[tuple, list[torch.Tensor]] = {}
    for it in items:
        key, prompt, free_steps, forced_steps = it["key"], it["prompt"], it["free_steps"], it["forced_steps"]
        a, tok = h.prefill(prompt)
        n = len(prompt)
        b, c = h.fork(a, n), h.fork(a, n)
        d = h.fork(a, n) if ref is not None else None  # full attention fed the reference's tokens
        path = ref_tokens[key] if ref is not None else None
        free = {"full": [tok], "omnikv": [tok]}
        stats: dict[str, list] = {k: [] for k in ("kl_full", "flip_full", "kl_omnikv", "flip_omnikv",
                                                 "kl_within", "flip_within")}
        mine: list[torch.Tensor] = []
        forced_tok = path[0] if path is not None else tok
        ran = {a: 0, b: 0, c: 0, **({d: 0} if d is not None else {})}  # decode steps each row took
        for i in range(max(free_steps, forced_steps)):
            rows = []
            if i < free_steps or path is None:
                rows += [(a, n + i, free["full"][-1], False)]
            if i < free_steps:
                rows += [(b, n + i, free["omnikv"][-1], True)]
            if i < forced_steps:
                rows += [(c, n + i, forced_tok, True)] + ([(d, n + i, forced_tok, False)] if d is not None else [])
            lg = h.logits(rows).log_softmax(-1)
            for row, *_ in rows:
                ran[row] += 1
            j = 0
            if i < free_steps or path is None:
                free["full"].append(int(lg[j].argmax()))
                j += 1
            if i < free_steps:
                free["omnikv"].append(int(lg[j].argmax()))
                j += 1
            if i < forced_steps:
                sparse = lg[j]
                full = lg[j + 1] if d is not None else lg[0]
                want = ref[key][i] if ref is not None else full
                if ref is None:
                    mine.append(full.clone())
                top = int(want.argmax())
                stats["kl_full"].append(kl(want, full))
                stats["flip_full"].append(int(full.argmax()) != top)
                stats["kl_omnikv"].append(kl(want, sparse))
                stats["flip_omnikv"].append(int(sparse.argmax()) != top)
                stats["kl_within"].append(kl(full, sparse))
                stats["flip_within"].append(int(sparse.argmax()) != int(full.argmax()))
                forced_tok = path[i + 1] if path is not None else int(full.argmax())
        h.release(list(ran), n, [n + k for k in ran.values()])
        texts = {k: h.tok.decode(until_eos(v[: free_steps + 1], stop)).strip() for k, v in free.items()}
        out[key] = {"texts": texts, "answers": {k: answer(v) for k, v in texts.items()}, "code": it.get("code"),
                    **stats, "tokens": free["full"][: forced_steps + 1] if path is None else None}
        if ref is None:
            logs[key] = mine
    return out, logs


def floor(model: str, budget: float, overrides: dict[str, Any], h32: Harness, ids: list[int], lengths: list[int],
          depths: int, answer_tokens: int, forced_tokens: int, seeds: list[int], doc_contexts: list[int],
          n_doc: int, doc_tokens: int, llama_threads: int) -> dict[str, Any]:
    """How far OmniKV moves the answers, next to how far a bf16 KV cache and another implementation
    (llama.cpp, `llama_threads` > 0) move them: the needle prompts of `seeds` (and `n_doc` prompts
    of documentation) in fp32 (the reference) and as served, each with full attention and OmniKV, and by
    llama.cpp; each answered freely and fed the reference full attention's tokens. The needle answers
    hinge on near-ties where full attention makes a number up: this is the rate at which changes nobody
    calls a fault change them."""
    items: list[dict[str, Any]] = []
    for seed in seeds:
        for d, code, prompt in needle_prompts(h32, ids, lengths, depths, seed):
            items.append({"key": ("needle", seed, len(prompt), d), "prompt": prompt, "code": code,
                          "free_steps": answer_tokens - 1, "forced_steps": forced_tokens})
    for ctx in doc_contexts:
        for k, prompt in enumerate(doc_prompts(h32, ids, ctx, n_doc, doc_tokens)):
            items.append({"key": ("doc", ctx, k), "prompt": prompt, "free_steps": 0, "forced_steps": doc_tokens})
    runs: dict[str, dict[tuple, dict[str, Any]]] = {}
    t0 = time.perf_counter()
    runs["fp32"], ref = floor_pass(h32, items, None, {})
    ref_tokens = {k: v["tokens"] for k, v in runs["fp32"].items()}
    print(f"floor fp32: {len(items)} prompts, {time.perf_counter() - t0:.0f} s", flush=True)
    # the model as `mlaserve serve` runs it: the native forward keeps its activations in fp32 there too,
    # so this run differs from the reference in its KV cache alone (bf16 for GGUF blocks)
    t0 = time.perf_counter()
    served = Harness(model, budget, "auto", **overrides)
    runs["kv_bf16"], _ = floor_pass(served, items, ref, ref_tokens)
    served.runner.close()
    print(f"floor kv_bf16: {time.perf_counter() - t0:.0f} s", flush=True)
    if llama_threads:
        t0 = time.perf_counter()
        from models.builtin import resolve_model_path

        runs["llama_cpp"] = floor_llama(str(resolve_model_path(model)), items, ref, ref_tokens, llama_threads)
        print(f"floor llama_cpp: {time.perf_counter() - t0:.0f} s", flush=True)
    result: dict[str, Any] = {"runs": {"fp32": "native forward, fp32 KV cache (the reference)",
                                       "kv_bf16": "native forward as served (bf16 KV cache)",
                                       "llama_cpp": "llama-cpp-python on the same GGUF, its defaults (f16 KV cache; extra weight buffers off on a CPU with AMX-INT8, bench/peers.py)"},
                              "needle_seeds": seeds, "forced_steps": forced_tokens}
    mean = lambda xs: round(statistics.mean(xs), 5) if xs else None  # noqa: E731
    rate = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    for kind in ("needle", "doc"):
        keys = [k for k in runs["fp32"] if k[0] == kind]
        if not keys:
            continue
        table = {}
        for name, per in runs.items():
            cat = lambda f: [x for k in keys for x in per[k].get(f, [])]  # noqa: E731
            row = {"steps": len(cat("kl_full")),
                   "full_vs_fp32_full": {"mean_kl": mean(cat("kl_full")), "greedy_differs": rate(cat("flip_full"))}}
            if name != "llama_cpp":
                row["omnikv_vs_fp32_full"] = {"mean_kl": mean(cat("kl_omnikv")), "greedy_differs": rate(cat("flip_omnikv"))}
                row["omnikv_vs_own_full"] = {"mean_kl": mean(cat("kl_within")), "greedy_differs": rate(cat("flip_within"))}
            if kind == "needle":
                ref_ans = {k: runs["fp32"][k]["answers"]["full"] for k in keys}
                same = lambda who, against: rate([per[k]["answers"][who] == against[k] for k in keys])  # noqa: E731
                own = {k: per[k]["answers"]["full"] for k in keys}
                right = [k for k in keys if ref_ans[k] == str(runs["fp32"][k]["code"])]
                row["answers"] = {"prompts": len(keys), "full_same_as_fp32_full": same("full", ref_ans),
                                  "full_correct": rate([per[k]["answers"]["full"] == str(per[k]["code"]) for k in keys])}
                row["answers"]["where_fp32_full_correct"] = {
                    "prompts": len(right), "full_same": rate([per[k]["answers"]["full"] == ref_ans[k] for k in right])}
                if name != "llama_cpp":
                    row["answers"].update({
                        "omnikv_same_as_fp32_full": same("omnikv", ref_ans), "omnikv_same_as_own_full": same("omnikv", own),
                        "omnikv_correct": rate([per[k]["answers"]["omnikv"] == str(per[k]["code"]) for k in keys])})
                    row["answers"]["where_fp32_full_correct"]["omnikv_same"] = rate(
                        [per[k]["answers"]["omnikv"] == ref_ans[k] for k in right])
            table[name] = row
            print(f"floor {kind:6s} {name:12s}: {json.dumps(row)}", flush=True)
        result[kind] = table
    result["prompts"] = [{"key": list(k), **{n: {"answers": runs[n][k]["answers"], "texts": runs[n][k]["texts"]}
                                              for n in runs}, "code": runs["fp32"][k]["code"]}
                         for k in runs["fp32"] if k[0] == "needle"]
    return result


PARTS = ("speed", "fidelity", "needle", "divergence", "floor")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--parts", default="speed,fidelity,needle")
    p.add_argument("--budget", type=float, default=0.1, help="share of the context selected (default 0.1)")
    p.add_argument("--alpha", choices=("last_token", "uniform", "exponential"), default=None,
                   help="override the config's window weights")
    p.add_argument("--window", type=int, default=None, help="override the config's window")
    p.add_argument("--sink-tokens", type=int, default=None, help="override the config's sink_tokens")
    p.add_argument("--recent-tokens", type=int, default=None, help="override the config's recent_tokens")
    p.add_argument("--filter-layers", default=None, help="override the config's filter layers (comma-separated)")
    p.add_argument("--full-after-filter", choices=("on", "off"), default=None,
                   help="override the config's full_after_filter (off: the layer after each filter layer is "
                   "sparse too; on a GPU that layer hides the selected rows' transfer, on a CPU nothing moves)")
    p.add_argument("--contexts", default="1024,2048,4096,8000")
    p.add_argument("--rounds", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--fidelity-contexts", default="8000")
    p.add_argument("--fidelity-prompts", type=positive_int, default=3)
    p.add_argument("--fidelity-tokens", type=positive_int, default=256)
    p.add_argument("--needle-lengths", default="1024,2048,4096,8000")
    p.add_argument("--needle-depths", type=positive_int, default=10)
    p.add_argument("--needle-tokens", type=positive_int, default=24, help="answer tokens generated (default 24)")
    p.add_argument("--needle-seed", type=int, default=7,
                   help="seeds the passcodes (default 7: the committed results' set)")
    p.add_argument("--divergence-seeds", default="7,8",
                   help="passcode seeds of the divergence part, each a set of needle prompts (default 7,8)")
    p.add_argument("--divergence-tokens", type=int, default=16,
                   help="answer steps compared per prompt (default 16: the reply up to its passcode's last digit)")
    p.add_argument("--dtype", choices=("float32", "auto"), default="float32",
                   help="activations: float32 (default: the committed results'), or auto as `mlaserve serve` runs "
                   "the model (bf16 where the CPU does bf16 math); the KV cache as --kv-dtype auto makes it")
    p.add_argument("--floor-doc-prompts", type=int, default=3,
                   help="documentation prompts (at --fidelity-contexts, --fidelity-tokens) in the floor part (default 3)")
    p.add_argument("--floor-llama-threads", type=int, default=2,
                   help="threads of llama.cpp's run in the floor part (0: leave llama.cpp out; it is left out "
                   "where llama-cpp-python is not installed)")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", action="store_true", help="keep the other parts' results already in --out")
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    if not parts or parts - set(PARTS):  # a typo ran nothing, and without --merge wrote an empty result over --out
        p.error(f"--parts {a.parts}: the parts are {', '.join(PARTS)} (comma-separated)")
    if not 0.0 < a.budget <= 1.0:
        p.error(f"--budget {a.budget}: a share of the context, above 0 and at most 1")
    for flag in ("contexts", "fidelity_contexts", "needle_lengths", "filter_layers"):
        value = getattr(a, flag)
        if value is not None and not re.fullmatch(r"\d+(,\d+)*", value):
            p.error(f"--{flag.replace('_', '-')} {value}: comma-separated whole numbers, e.g. 1024,2048")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    overrides = {k: v for k, v in {
        "alpha": a.alpha, "window": a.window, "sink_tokens": a.sink_tokens, "recent_tokens": a.recent_tokens,
        "filter_layers": tuple(ints(a.filter_layers)) if a.filter_layers else None,
        "full_after_filter": None if a.full_after_filter is None else a.full_after_filter == "on",
    }.items() if v is not None}  # the config's settings the command line overrides
    try:
        h = Harness(a.model, a.budget, a.dtype, **overrides)
    except ValueError as e:  # settings the model's layers do not fit (a filter layer past them, ...)
        p.error(str(e))
    ids = h.tok.encode(doc_text(), add_special_tokens=False)
    freeze_gc_heap()  # as the engine process, once the model is loaded
    result: dict[str, Any] = {"bench": "omnikv_cpu", "model": a.model, "machine": machine_info(), "versions": versions(),
                              "config": h.cfg.to_dict(), "config_origin": h.origin,
                              "dtype": str(h.dtype).removeprefix("torch."),
                              "kv_dtype": str(h.kv_dtype).removeprefix("torch."),
                              "threads": h.runner.expert_pool.workers.num_threads}
    print(f"OmniKV config ({h.origin}): {h.cfg.to_dict()}", flush=True)
    if "speed" in parts:
        result["speed"] = speed(h, ids, ints(a.contexts), a.steps, a.rounds)
    if "fidelity" in parts:
        f = fidelity(h, ids, ints(a.fidelity_contexts), a.fidelity_prompts, a.fidelity_tokens)
        result["fidelity"] = {"runs": f, "mean_teacher_forced_agreement":
                              round(statistics.mean(x["teacher_forced_agreement"] for x in f), 4)}
    if "needle" in parts:
        nd = needle(h, ids, ints(a.needle_lengths), a.needle_depths, a.needle_tokens, seed=a.needle_seed)
        result["needle"] = {"seed": a.needle_seed, "runs": nd, "same_answer_rate": round(sum(x["same"] for x in nd) / len(nd), 4),
                            "same_text_rate": round(sum(x["same_text"] for x in nd) / len(nd), 4),
                            "full_correct_rate": round(sum(x["full_correct"] for x in nd) / len(nd), 4),
                            "omnikv_correct_rate": round(sum(x["omnikv_correct"] for x in nd) / len(nd), 4)}
        right = [x for x in nd if x["full_correct"]]  # where full attention found the needle
        result["needle"]["same_answer_rate_where_full_correct"] = (
            round(sum(x["same"] for x in right) / len(right), 4) if right else None)
        where_right = result["needle"]["same_answer_rate_where_full_correct"]
        print(f"needle: same answer {result['needle']['same_answer_rate']:.1%} "
              + ("(full attention right in no case)" if where_right is None else f"({where_right:.1%} where full attention is right)")
              + f", full correct "
              f"{result['needle']['full_correct_rate']:.1%}, OmniKV correct {result['needle']['omnikv_correct_rate']:.1%}")
    if "divergence" in parts:
        dv = divergence(h, ids, ints(a.needle_lengths), a.needle_depths, a.divergence_tokens, ints(a.divergence_seeds))
        result["divergence"] = dv
        print(f"divergence: mean KL {dv['mean_kl']}, p99 {dv['p99_kl']}, max {dv['max_kl']}; greedy choice differs "
              f"in {dv['flip_rate']:.2%} of {dv['steps']} steps (median margin there "
              f"{statistics.median(x['margin'] for x in dv['flips']) if dv['flips'] else None} nats)")
    if "floor" in parts:
        if h.dtype != torch.float32 or h.kv_dtype != torch.float32:
            p.error("the floor part's reference is fp32: run it with --dtype float32")
        result["floor"] = floor(a.model, a.budget, overrides, h, ids, ints(a.needle_lengths), a.needle_depths,
                                a.needle_tokens, a.divergence_tokens, ints(a.divergence_seeds),
                                ints(a.fidelity_contexts), a.floor_doc_prompts, a.fidelity_tokens,
                                a.floor_llama_threads if importlib.util.find_spec("llama_cpp") else 0)
    out = a.out or f"bench/results/omnikv_cpu_{machine_tag(result['machine'])}.json"
    if a.merge and Path(out).is_file():  # keep the parts not run now (same config only)
        old = json.loads(Path(out).read_text())
        if old.get("config") == result["config"] and old.get("dtype", "float32") == result["dtype"]:
            result = {**old, **result}
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
