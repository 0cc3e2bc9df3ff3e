"""The scheduler: which tokens of which requests go into the next forward, and what follows from it.

One `step()` reads aloud:  schedule -> run -> update.

schedule  Every decoding request gets its one token (all running requests decode every step, so a
          long prompt never stalls them). Then prefill work fills a token budget
          (`max_prefill_tokens`): first the unfinished chunks of requests already admitted, then new
          requests in arrival order (FCFS), each taking at most `chunked_prefill_size` tokens per
          step, while request slots and KV slots last. A new request first looks up the longest
          cached prefix of its tokens in the prefix cache and only computes the rest; one whose
          prompt shares at least `SHARED_PREFIX_WAIT` tokens more with a prompt being prefilled
          waits until that prefill has passed them (it then finds them cached) instead of computing
          them a second time beside it. Decode and
          prefill slices share one forward (a MIXED batch) when both exist.
          KV short: evict unlocked prefix-cache leaves; still short for the decodes: retract prompts
          part-way through their prefill (newest first), then the most recently admitted decoding
          requests (free their KV, put them back at the head of the queue; their tokens are
          recomputed later, nothing is lost). Short for a prompt's next chunk: the newer prompts
          part-way in give theirs back, so that the oldest always moves (prompts in chunks could
          otherwise fill the pool between them, none able to go on). A request alone too long for
          the whole pool finishes with `length`.
run       `ModelRunner.build_batch` + forward: logits for the last token of every slice.
update    Each prefill chunk's KV goes into the prefix cache as soon as it is computed (so requests
          sharing a prompt with one still running, or retracted, or aborted part-way, find it
          there, as SGLang caches unfinished requests). Slices that completed their request's
          pending tokens sample the next token; stop checks (EOS, stop ids, max_tokens, context
          end); finished requests hand their KV to the prefix cache (or free it) at once.

n > 1: completions 1..n-1 wait until completion 0 has prefilled the prompt (then in the prefix
cache), so they start from the shared prompt KV.

Priority (`policy="priority"`, vLLM's): the queue is kept in (priority, arrival) order, lower first, prompt
chunks go best first, and the worst (priority, arrival) of the running requests, prompts part-way in and
decodes alike, gives its KV back first (as vLLM preempts).

Speculative decoding (`speculative`, scheduler/speculative.py): a decoding completion whose tokens an
n-gram lookup can continue feeds its last token and the draft as one slice with logits at every
position; `_update` samples each position as its own decode step and keeps tokens while they equal
the draft (`_verify`), then frees the KV slots of the draft tokens it did not keep. Drafts take only
room nothing else wants (free or evictable slots past the decodes' and the step's prefill budget): a
draft never costs a retraction nor holds a prompt back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from executor.logprobs import TokenLogprob
from executor.model_runner import ModelRunner, RequestSlice
from scheduler.radix_cache import PrefixCache
from scheduler.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Req
from scheduler.speculative import NgramProposer, PredictionProposer, SpeculativeConfig
from executor.sampler import Sampler, SamplingRow, token_logprobs, token_ranks

logger = logging.getLogger("mlaserve.scheduler")

# A new request waits for a prompt being prefilled when that prefill has at least this many of its
# tokens still to compute (SGLang's in-batch prefix check uses 32): fewer cost less than the wait.
SHARED_PREFIX_WAIT = 32


@dataclass
class SchedulerCounters:
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up, counted with the hits (first admission)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    retractions: int = 0
    aborted: int = 0
    forward_steps: int = 0
    forward_seconds: float = 0.0  # building the batch and the model forward, not scheduling or sampling
    # speculative decoding: verification slices, the draft tokens they carried, and those kept
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: PrefixCache,
        sampler: Sampler,
        *,
        eos_token_ids: Sequence[int],
        context_len: int,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_prefill_tokens: int,
        omnikv_mode: str = "off",
        omnikv_min_context: int = 0,
        speculative: SpeculativeConfig | None = None,
        policy: str = "fcfs",
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.sampler = sampler
        self.eos_token_ids = tuple(eos_token_ids)
        self.context_len = context_len
        self.max_running = max_running_requests
        self.chunk = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.omnikv_mode, self.omnikv_min_context = omnikv_mode, omnikv_min_context
        self.speculative = speculative
        self.by_priority = policy == "priority"  # waiting in (priority, arrival) order, not arrival order
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.counters = SchedulerCounters()

    # ------------------------------------------------------------------ intake
    def add(self, reqs: Sequence[Req]) -> None:
        for r in reqs:
            self.counters.prompt_tokens += len(r.prompt_ids) if r.index == 0 else 0
            self._queue(r)

    def _queue(self, r: Req, front: bool = False) -> None:
        """Puts r in the waiting queue: at its end (`front`: a retracted request, at its head), or, by
        priority, after every request of its priority or better that arrived before it (a retracted one
        arrived before those admitted after it), so equal priorities keep arrival order."""
        if not self.by_priority:
            self.waiting.appendleft(r) if front else self.waiting.append(r)
            return
        key = self._rank(r)
        at = next((i for i, w in enumerate(self.waiting) if self._rank(w) > key), len(self.waiting))
        self.waiting.insert(at, r)

    def _rank(self, r: Req) -> tuple[int, float]:
        """Which of two requests goes first under the priority policy: the lower (priority, arrival)."""
        return r.params.priority, r.arrival_time

    def _victim(self, prefilling: list[Req], decoding: list[Req]) -> Req:
        """The running request to give its KV back when the decodes need more: fcfs, a prompt part-way in (the
        newest: it is the least along), else the latest admitted decode; priority, the worst (priority,
        arrival) of them all, as vLLM preempts (the later listed of equals)."""
        if self.by_priority:
            both = prefilling + decoding
            return both[max(range(len(both)), key=lambda i: (*self._rank(both[i]), i))]
        return prefilling[-1] if prefilling else max(decoding, key=lambda r: r.first_scheduled_time or 0.0)

    def abort(self, rid: str, index: int | None = None) -> list[Req]:
        """Finishes every completion of `rid` (or completion `index` alone) with `abort`, freeing its KV now."""
        out = []
        mine = (lambda r: r.rid == rid) if index is None else (lambda r: r.rid == rid and r.index == index)
        for r in [r for r in self.waiting if mine(r)]:
            self.waiting.remove(r)
            out.append(r)
        for r in [r for r in self.running if mine(r)]:
            self._release(r, cache=False)
            self.running.remove(r)
            out.append(r)
        for r in out:
            r.finish_reason = FINISH_ABORT
        if out:
            self.counters.aborted += 1
            self._unblock_siblings(rid)
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Req]:
        """Runs one forward; returns the requests with something to report (tokens or an end)."""
        slices, reqs, finished = self._schedule()
        if not slices:
            return finished
        now = time.time()
        for r in reqs:
            r.first_scheduled_time = r.first_scheduled_time or now
        # prompt scoring and a draft's verification need the logits of every position
        every = [r.scores_prompt or bool(r.draft) for r in reqs]
        t = time.perf_counter()
        logits = self.runner.forward(self.runner.build_batch(slices, all_logits=every))
        self.counters.forward_seconds += time.perf_counter() - t
        self.counters.forward_steps += 1
        return finished + self._update(reqs, slices, logits, every)

    # ------------------------------------------------------------------ schedule
    def _schedule(self) -> tuple[list[RequestSlice], list[Req], list[Req]]:
        slices: list[RequestSlice] = []
        reqs: list[Req] = []
        finished: list[Req] = []
        alloc = self.runner.allocator
        decoding = [r for r in self.running if r.is_decoding]
        prefilling = [r for r in self.running if not r.is_decoding]  # oldest first (admission order)
        if self.by_priority:  # prefill chunks go best first, and the worst gives its KV back first
            prefilling.sort(key=self._rank)
        while decoding and not self._make_room(sum(alloc.slots_needed(r.kv_len, 1) for r in decoding)):
            victim = self._victim(prefilling, decoding)
            if victim in prefilling:
                prefilling.remove(victim)
                self._retract(victim)
                continue
            if len(decoding) == 1 and not prefilling:  # alone and still no room: the pool cannot hold a longer sequence
                self._finish(victim, FINISH_LENGTH)
                finished.append(victim)
            else:
                self._retract(victim)
            decoding.remove(victim)
        need = sum(alloc.slots_needed(r.kv_len, 1) for r in decoding)  # KV slots the slices so far take
        if decoding and (self.speculative is not None or any(r.params.prediction for r in decoding)):
            # drafts take only room nothing else wants: free or evictable slots past the decodes' and this
            # step's prefill budget, so a draft never costs a retraction nor holds a prompt back
            spare = alloc.available_size() + self.cache.evictable_size() - need
            room = spare - (self.max_prefill_tokens if prefilling or self.waiting else 0)
            if self._propose(decoding, room):
                # (page size 1: a slot a draft token; paged, drafts that open pages may cost more than the room,
                # and then there are none this step)
                with_drafts = sum(alloc.slots_needed(r.kv_len, 1 + len(r.draft)) for r in decoding)
                if with_drafts - need <= room and self._make_room(with_drafts):
                    need = with_drafts
                else:
                    for r in decoding:
                        r.draft, r.draft_masks = [], []
        for r in decoding:  # (a prompt's last token, left alone by its chunks, is prefill: full attention)
            sparse = r.kv_len >= len(r.prompt_ids) and self._omnikv(r)
            if sparse and r.sparse_kv_from is None and self.runner.omnikv_cuts(r.kv_len + 1):
                r.sparse_kv_from = r.kv_len  # (a step that cuts nothing computes full attention's KV)
            slices.append(RequestSlice(r.row, r.kv_len, r.ids(r.kv_len) + r.draft, omnikv=sparse))
            reqs.append(r)

        budget = self.max_prefill_tokens
        i = 0
        while i < len(prefilling):  # unfinished chunks first, oldest first
            r = prefilling[i]
            n = min(r.num_pending, self.chunk, budget)
            if n <= 0:
                break
            cost = alloc.slots_needed(r.kv_len, n)
            # prompts part-way in can fill the pool between them, none able to go on: the newest give
            # theirs back (retracted, recomputed later) so that the oldest always moves
            while not self._make_room(need + cost) and len(prefilling) > i + 1:
                self._retract(prefilling.pop())
            if not self._make_room(need + cost):
                break
            i += 1
            slices.append(RequestSlice(r.row, r.kv_len, r.ids(r.kv_len, r.kv_len + n)))
            reqs.append(r)
            budget -= n
            need += cost

        held = 0  # request slots kept for requests waiting on a shared prefix: later ones do not take them
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) + held >= self.max_running:
                break
            if r.waits_for_sibling:
                continue
            if self._waits_for_shared_prefix(r):
                held += 1
                continue
            # a retracted request grown past the pool (its next token needs a slot more; a prompt only
            # scored, max_tokens 0, needs none: one that fills the pool exactly still runs)
            if r.seq_len + (r.params.max_tokens != 0) > self.runner.allocator.num_slots:
                self.waiting.remove(r)
                r.finish_reason = FINISH_LENGTH
                finished.append(r)
                if r.index == 0:  # n > 1: as `_finish` lets them go
                    self._unblock_siblings(r.rid)
                continue
            n = self._admit(r, budget, need)
            if n is None:
                break
            self.waiting.remove(r)
            self.running.append(r)
            slices.append(RequestSlice(r.row, r.kv_len, r.ids(r.kv_len, r.kv_len + n)))
            reqs.append(r)
            budget -= n
            need += alloc.slots_needed(r.kv_len, n)
        return slices, reqs, finished

    def _waits_for_shared_prefix(self, r: Req) -> bool:
        """Whether a prompt being prefilled (admitted in an earlier step or this one) shares r's first
        SHARED_PREFIX_WAIT tokens past what it has computed: r then waits for them to be cached, its request
        slot kept. The prefill always moves (the oldest prompt part-way in keeps its room), so the wait ends."""
        if not self.cache.shares or r.scores_prompt:  # a prompt scored is computed whole anyway
            return False
        for other in self.running:
            # (siblings: waits_for_sibling; a prompt scored computes from 0 whatever is cached, so how far it
            # is says nothing of what r would find cached: a stream of them would hold r for good)
            if (other.is_decoding or other.rid == r.rid or other.scores_prompt
                    or other.params.cache_salt != r.params.cache_salt):  # (another salt's KV is never r's)
                continue
            # (paged, the cache holds whole pages: r would find nothing more unless the shared part reaches the
            # next page's end)
            end = other.kv_len + SHARED_PREFIX_WAIT
            end += (-end) % self.cache.page_size
            if end < r.seq_len and end <= other.seq_len \
                    and other.ids(end - SHARED_PREFIX_WAIT, end) == r.ids(end - SHARED_PREFIX_WAIT, end) \
                    and other.ids(0, end) == r.ids(0, end):  # (the cheap test first: most prompts part early)
                return True
        return False

    def _omnikv(self, r: Req) -> bool:
        """Whether r decodes with OmniKV: its own choice, else the server's (auto: a long enough context)."""
        if r.params.omnikv is not None:
            return r.params.omnikv
        return self.omnikv_mode == "on" or (self.omnikv_mode == "auto" and r.seq_len >= self.omnikv_min_context)

    def _propose(self, decoding: list[Req], room: int) -> int:
        """Sets each decoding completion's draft: the tokens its proposer (n-gram lookup, or its predicted
        output) proposes, as many as its
        max_tokens and the context leave room for (the verification may add one more token), `room` KV
        slots in all at most. Returns the draft tokens given."""
        spec = self.speculative
        if spec is not None and spec.disable_by_batch_size is not None and len(decoding) > spec.disable_by_batch_size:
            return 0
        given = 0
        for r in decoding:
            if given >= room:
                break
            # (the last prompt token left alone by its chunks is prefill)
            if not r.output_ids or not self._drafts_allowed(r):
                continue
            proposer = self._proposer(r)
            k = min(proposer.length, self.context_len - r.seq_len)
            if r.params.max_tokens is not None:
                k = min(k, r.params.max_tokens - len(r.output_ids) - 1)
            k = min(k, room - given)
            if k > 0:
                draft = proposer.propose(r.ids, r.seq_len, k)
                if draft and r.grammar is not None:  # what the grammar allows of it, and each position's mask
                    draft, masks = r.grammar.along(draft, self.sampler.vocab_size)
                    r.draft_masks = masks if draft else []
                r.draft = draft
                given += len(r.draft)
        return given

    def _drafts_allowed(self, r: Req) -> bool:
        """Whether r may decode with drafts: not with OmniKV (its sparse rows decode one token, and its query
        window counts decode steps). Under a grammar a draft is cut where the grammar refuses it, and each
        position is sampled with the mask after the draft's tokens before it (`Grammar.along`)."""
        return (self.speculative is not None or bool(r.params.prediction)) and (
            r.params.omnikv is False or (r.params.omnikv is None and self.omnikv_mode == "off"))

    def _proposer(self, r: Req) -> NgramProposer | PredictionProposer:
        """r's drafts: from its predicted output (OpenAI's `prediction`), the server's n-gram lookup behind
        it; or the n-gram lookup alone."""
        if r.proposer is None:
            ngram = NgramProposer(self.speculative) if self.speculative is not None else None
            if r.params.prediction:
                r.proposer = PredictionProposer(r.params.prediction, len(r.prompt_ids), ngram)
            else:
                assert ngram is not None
                r.proposer = ngram
        return r.proposer

    def _admit(self, r: Req, budget: int, need: int) -> int | None:
        """Gives `r` a request slot and its cached prefix; returns how many tokens it prefills now,
        or None when there is no room (`need` slots are already promised to this step's slices)."""
        # keep >= 1 token to compute; a prompt to score is computed whole (cached positions have no logits)
        match = self.cache.match_prefix([] if r.scores_prompt else r.all_ids[: r.seq_len - 1], r.params.cache_salt)
        self.cache.lock(match.node)
        cached = int(match.kv_indices.numel())
        n = min(r.seq_len - cached, self.chunk, budget)
        # room for this chunk plus one decode step (one page) of everything already running
        alloc = self.runner.allocator
        room = self._make_room(need + alloc.slots_needed(cached, n) + len(self.running) * alloc.page_size)
        row = self.runner.req_to_token_pool.alloc() if room else None
        if row is None:
            self.cache.unlock(match.node)
            return None
        if cached:
            self.runner.req_to_token_pool.write(row, 0, match.kv_indices)
        if r.first_scheduled_time is None:
            r.cached_tokens = cached
            self.counters.prefix_cache_hit_tokens += cached
            # with caching off, or for a prompt scored whole, nothing is looked up: no query to count
            if self.cache.shares and not r.scores_prompt:
                self.counters.prefix_cache_query_tokens += r.seq_len
        r.row, r.node, r.cache_len, r.kv_len = row, match.node, cached, cached
        return n

    def _make_room(self, n: int) -> bool:
        alloc = self.runner.allocator
        short = n - alloc.available_size()
        if short > 0:
            self.cache.evict(short)
        return alloc.available_size() >= n

    # ------------------------------------------------------------------ update
    def _update(self, reqs: list[Req], slices: list[RequestSlice], logits: torch.Tensor,
                every: list[bool]) -> list[Req]:
        # (request, its first logits row to sample, how many: 1, or a draft's verification: 1 + its tokens)
        complete: list[tuple[Req, int, int]] = []
        out: list[Req] = []
        row = 0
        for r, s, all_rows in zip(reqs, slices, every):
            n = len(s.input_ids)
            if r.draft:  # decoding (the draft's KV past what it keeps is freed in _verify)
                complete.append((r, row, n))
                row += n
                r.kv_len += n
                continue
            if all_rows:
                self._score_prompt(r, logits[row : row + n])
                row += n
            else:
                row += 1
            prefill = n > 1 or not r.output_ids  # (a decode step's token is cached when the request ends)
            r.kv_len += n
            if prefill and self.cache.shares:
                self._insert_into_cache(r, finished=False)
            if prefill and r.params.max_tokens != 0 and self._drafts_allowed(r):
                # its n-gram index, built along the prompt's chunks rather than at the first draft
                self._proposer(r).index(r.ids, min(r.kv_len, r.seq_len - 1))
            if r.num_pending == 0:
                if r.params.max_tokens == 0:  # prompt scoring only: nothing to generate
                    self._finish(r, FINISH_LENGTH)  # (its prompt KV goes to the prefix cache)
                    out.append(r)
                else:
                    complete.append((r, row - 1, 1))
        if not complete:
            return out
        # a draft's position j is sampled as its own decode step: after the draft's first j tokens
        rows = [SamplingRow(r.params, r.seed, len(r.output_ids) + j, r.prompt_ids,
                            r.output_ids + r.draft[:j] if j else r.output_ids, self.eos_token_ids,
                            r.draft_masks[j] if r.draft and r.grammar is not None else r.grammar)
                for r, _, count in complete for j in range(count)]
        picked = [first + j for _, first, count in complete for j in range(count)]
        # (a decode-only batch samples every row in order: no gather copy of [B, V] logits)
        whole = picked == list(range(row))  # row: the logits rows of the batch
        found = self.runner.last_argmax
        result = self.sampler(logits if whole else logits[picked], rows,
                              argmax=None if found is None else found if whole else [found[i] for i in picked])
        now = time.time()
        no_choice = set(result.no_choice)
        k = 0
        for r, _, count in complete:
            reason = self._verify(r, result.token_ids[k : k + count], result.logprobs[k : k + count],
                                  {j - k for j in no_choice if k <= j < k + count} if no_choice else no_choice, now)
            k += count
            if reason:
                self._finish(r, reason)
            out.append(r)
        return out

    def _verify(self, r: Req, tokens: list[int], logprobs: list[TokenLogprob | None], no_choice: set[int],
                now: float) -> str | None:
        """Takes r's sampled tokens (one, or one per position of its draft's verification) while each
        equals the draft token it checks; frees the KV of the draft tokens not kept. `no_choice`: positions
        where nothing the request allows could come. Returns why r ends, or None."""
        draft, r.draft = r.draft, []
        r.draft_masks = []
        first_kv = r.kv_len - len(tokens)  # the position of the token before the draft (its KV stays)
        taken, reason = 0, None
        for j, tok in enumerate(tokens):
            if j in no_choice:  # nothing the request allows could come next: it ends without a token
                logger.warning("request %s: its allowed_token_ids / bad_words / min_tokens / grammar leave no "
                               "token after %d generated; ending it", r.rid, len(r.output_ids))
                reason = FINISH_STOP
                break
            reason = self._append(r, tok, logprobs[j], now)
            taken += 1
            if reason or j == len(draft) or tok != draft[j]:
                break
        if draft:
            kept = sum(tokens[j] == draft[j] for j in range(min(taken, len(draft))))
            self.counters.spec_drafts += 1
            self.counters.spec_draft_tokens += len(draft)
            self.counters.spec_accepted_tokens += kept
            assert r.proposer is not None
            r.proposer.verified(len(draft), kept)
            self._drop_kv_after(r, first_kv + max(taken, 1))
        return reason

    def _append(self, r: Req, tok: int, lp: TokenLogprob | None, now: float) -> str | None:
        """Adds a sampled token to r's output; returns why r ends with it, or None."""
        prefilled_prompt = not r.output_ids
        r.output_ids.append(tok)
        r.pending_ids.append(tok)
        if lp is not None:
            r.pending_logprobs.append(lp)
        r.first_token_time = r.first_token_time or now
        self.counters.generation_tokens += 1
        if prefilled_prompt and r.index == 0:  # n > 1: its prompt is cached now, the siblings may go
            self._unblock_siblings(r.rid)
        reason = self._stop_reason(r, tok)
        if r.grammar is not None:
            if not r.grammar.accept(tok):  # never expected: the mask allowed it
                logger.error("request %s: the grammar refused token %d its mask allowed; ending it", r.rid, tok)
                reason = reason or FINISH_STOP
            elif r.grammar.terminated:  # the document is complete
                reason = reason or FINISH_STOP
        return reason

    def _score_prompt(self, r: Req, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens these rows predict (row j at position p predicts token p+1)."""
        if r.prompt_logprobs is None:
            r.prompt_logprobs = [None]  # nothing predicts the first token
        k = r.params.prompt_logprobs or 0
        rows = [j for j in range(logits.shape[0])
                if len(r.prompt_logprobs) <= r.kv_len + j + 1 < len(r.prompt_ids)]  # not scored before a retraction
        tokens = [r.prompt_ids[r.kv_len + j + 1] for j in rows]
        ranks = token_ranks(logits, rows, tokens)
        r.prompt_logprobs.extend(msgspec.structs.replace(lp, rank=rank)
                                 for lp, rank in zip(token_logprobs(logits, rows, tokens, [k] * len(rows)), ranks))

    def _stop_reason(self, r: Req, tok: int) -> str | None:
        p = r.params
        if len(r.output_ids) >= p.min_tokens:
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                return FINISH_STOP
        if p.max_tokens is not None and len(r.output_ids) >= p.max_tokens:
            return FINISH_LENGTH
        if r.seq_len >= self.context_len:
            return FINISH_LENGTH
        return None

    def _finish(self, r: Req, reason: str) -> None:
        r.finish_reason = reason
        self._release(r, cache=True)
        self.running.remove(r)
        if r.index == 0:  # n > 1: siblings still waiting for its prompt (it ended before a token) may go
            self._unblock_siblings(r.rid)

    # ------------------------------------------------------------------ KV ownership
    def _unblock_siblings(self, rid: str) -> None:
        for s in self.waiting:
            if s.rid == rid:
                s.waits_for_sibling = False

    def _insert_into_cache(self, r: Req, finished: bool) -> None:
        """Hands r's own KV to the prefix cache. Duplicates of what the cache already held are freed;
        unless `finished`, r re-locks the now-longer cached prefix and keeps going. KV that OmniKV's sparse
        decode steps wrote is not shared (a later prompt holding those tokens, a chat's next turn, would take
        rows a full-attention prefill computes otherwise): it is freed with the request."""
        assert r.row is not None
        pool = self.runner.req_to_token_pool
        end = r.kv_len if r.sparse_kv_from is None else max(r.cache_len, min(r.sparse_kv_from, r.kv_len))
        assert finished or end == r.kv_len  # (sparse rows come from decode steps, which insert when they end)
        end -= end % self.cache.page_size  # whole pages: a part-filled last page stays r's (freed with it)
        slots = pool.req_to_token[r.row, : r.kv_len].to(torch.int64)
        already = self.cache.insert(r.all_ids[:end], slots[:end], r.params.cache_salt)
        if not self.cache.shares:  # caching off: it keeps nothing, everything we own stays ours
            if finished:
                self.runner.allocator.free(slots[r.cache_len :])
            return
        if already > r.cache_len:
            self.runner.allocator.free(slots[r.cache_len : already])
        if end < r.kv_len and finished:
            self.runner.allocator.free(slots[end:])
        self.cache.unlock(r.node)
        r.node = None
        if not finished:
            match = self.cache.match_prefix(r.all_ids[: r.kv_len], r.params.cache_salt)
            self.cache.lock(match.node)
            pool.write(r.row, 0, match.kv_indices)
            r.node, r.cache_len = match.node, int(match.kv_indices.numel())

    def _drop_kv_after(self, r: Req, kv_len: int) -> None:
        """Frees r's own KV slots from position `kv_len` on (a draft's tokens not kept). Paged: the pages
        wholly past it; the slots left in its last page are written again by the next tokens."""
        if kv_len < r.kv_len:
            assert r.row is not None and kv_len > r.cache_len
            start = kv_len + (-kv_len) % self.runner.allocator.page_size
            if start < r.kv_len:
                self.runner.allocator.free(self.runner.req_to_token_pool.req_to_token[r.row, start : r.kv_len].to(torch.int64))
            r.kv_len = kv_len

    def _release(self, r: Req, cache: bool) -> None:
        """Frees (or caches) all KV of a running request and its request slot."""
        r.draft, r.draft_masks = [], []
        if r.row is None:
            return
        if cache:
            self._insert_into_cache(r, finished=True)
        else:
            slots = self.runner.req_to_token_pool.req_to_token[r.row, r.cache_len : r.kv_len].to(torch.int64)
            self.runner.allocator.free(slots)
        if r.node is not None:
            self.cache.unlock(r.node)
        self.runner.req_to_token_pool.free(r.row)
        r.row, r.node, r.cache_len, r.kv_len, r.sparse_kv_from = None, None, 0, 0, None

    def _retract(self, r: Req) -> None:
        self._release(r, cache=False)
        self.running.remove(r)
        self._queue(r, front=True)
        self.counters.retractions += 1

    def kv_slots_used(self) -> int:
        alloc = self.runner.allocator
        return alloc.num_slots - alloc.available_size() - self.cache.evictable_size()
