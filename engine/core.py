"""`EngineCore`: the model, its pools, the scheduler and the sampler, behind four calls.

It runs inside the engine process (`engine_process.py`), single-threaded: `add_request`, `abort`,
`step` and `stats` are called from that process's loop only. Parameters are validated at the server
edge (`SamplingParams.validate`, `validate_prompt_ids`), where a `ParamError` becomes a 400 naming
the parameter. The core runs the same two functions again only as a guard — one bad token id would
crash the step that batches every other request — and checks what only it knows (the KV cache's
size, its queues): anything it cannot honour becomes an immediate error output with a code the
server maps to an HTTP status, never an exception in the loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import secrets
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import torch

from models.config import DeepseekConfig, ModelConfig
from models.loader.load import load_model
from models.omnikv_config import OmniKVConfig, model_label
from models.parallel import local_kv_heads
from engine.args import MIN_CONTEXT, EngineArgs
from engine.cgroups import memory_room
from engine.ranks import DPAttentionRank, LeadRank, load_rank
from engine.messages import (
    ERR_CONTEXT,
    context_message,
    overloaded_message,
    ERR_ENGINE,
    FINISH_ABORT,
    ERR_INVALID,
    ERR_OVERLOADED,
    FINISH_ERROR,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    RequestOutput,
    mlaserve_version,
)
from scheduler.sampling_params import ParamError, validate_prompt_ids
from executor.cpu_forward import kv_dtype_setting
from executor.grammar import GrammarBackend, GrammarError
from executor.model_runner import ModelRunner, bank_layers
from scheduler.radix_cache import create_prefix_cache
from scheduler.request import Req
from executor.sampler import Sampler, mix64
from scheduler.scheduler import Scheduler
from scheduler.speculative import PredictionProposer, SpeculativeConfig

logger = logging.getLogger("mlaserve.engine")


def end_ids(ids: set[int], vocab_size: int) -> set[int]:
    """The end-of-generation ids the model can produce. A config or tokenizer may name one past the LM
    head's rows (a tokenizer larger than the model): it can never be sampled, and masking it for
    `min_tokens` would index past the logits, so it is dropped, with a warning."""
    kept = {i for i in ids if 0 <= i < vocab_size}
    if outside := sorted(ids - kept):
        logger.warning("end-of-generation token ids %s are outside the model's vocabulary (0..%d) and can never "
                       "be generated: ignored", outside, vocab_size - 1)
    return kept


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """DeepSeek: (kv_lora_rank + rope_dim) x bytes x layers (576 x 2 x layers in bf16); Llama: K and V per KV head."""
    size = torch.tensor([], dtype=dtype).element_size()
    if isinstance(cfg, DeepseekConfig):
        return cfg.kv_cache_dim * size * cfg.num_hidden_layers
    # under tensor parallelism, this rank's KV heads
    return 2 * local_kv_heads(cfg.num_key_value_heads) * cfg.head_dim * size * cfg.num_hidden_layers


def available_memory(device: torch.device) -> int:
    """Free bytes on the device; on the CPU the host's available RAM, or what the process's memory cgroup
    (a container's limit) still allows, whichever is less: /proc/meminfo shows the host's memory inside a
    container, and a cache sized from it grows (as its pages are written) until the container is killed."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = 4 << 30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    room = memory_room()
    return free if room is None else min(free, room)


GRAMMAR_WAIT_S = 0.002  # with nothing else to run, how long one step waits for a grammar to compile


@dataclass
class _Compiling:
    """A structured-output request whose grammar is compiling: it joins the scheduler when it is done."""

    reqs: list[Req]
    future: Future
    report_admission: bool = False


def _refusal(rid: str, prompt_tokens: int, arrival_time: float, message: str, code: str,
             param: str | None = None) -> RequestOutput:
    """The one output of a request the core will not run: the server turns `code` into its HTTP error."""
    return RequestOutput(rid, 0, [], finish_reason=FINISH_ERROR, prompt_tokens=prompt_tokens, error=message,
                         error_code=code, error_param=param, arrival_time=arrival_time)


def _admitted(req: Req) -> RequestOutput:
    """The output telling the server that request `req.rid` passed every check and waits to run."""
    return RequestOutput(req.rid, 0, [], prompt_tokens=len(req.prompt_ids), arrival_time=req.arrival_time,
                         admitted=True)


def _mix_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the completions of one seeded request, hashed: the sampler's
    noise for (seed, step) is SplitMix64 over seed + step * golden, so a child seed that is linear in the
    seed in those steps (seed * golden + ...) would replay a neighbouring seed's child shifted by a step."""
    return mix64(mix64(seed) + index) & ((1 << 63) - 1)


def _warn_if_never_sparse(omnikv: OmniKVConfig, context_len: int, mode: str) -> None:
    """Warns of an OmniKV config under which no decode step of this server can be sparse: a budget that keeps
    every token of its longest context, or (`--omnikv auto`) a min_context past that context."""
    if omnikv.budget_tokens is None and omnikv.budget_ratio >= 1:
        logger.warning("OmniKV: a budget of %.0f%% of the context keeps every token, so no decode step is "
                       "sparse and OmniKV changes nothing; give a budget_ratio below 1 or budget_tokens",
                       omnikv.budget_ratio * 100)
    elif omnikv.budget_tokens is not None and not omnikv.is_sparse_for(context_len):
        logger.warning("OmniKV: budget_tokens %d with %d sink and %d recent tokens keeps every token of the "
                       "longest context (%d), so no decode step is sparse and OmniKV changes nothing; give "
                       "budget_tokens of at most %d or a budget_ratio", omnikv.budget_tokens, omnikv.sink_tokens,
                       omnikv.recent_tokens, context_len, max(1, context_len - omnikv.sink_tokens - omnikv.recent_tokens - 1))
    elif mode == "auto" and omnikv.min_context > context_len:
        logger.warning("OmniKV: --omnikv auto turns it on from %d tokens, past the longest context (%d): it never "
                       "turns on; give a smaller min_context, or --omnikv on", omnikv.min_context, context_len)


def _ends_digest(path: Path, span: int = 1 << 20) -> str:
    """A hash of a file's first and last `span` bytes (the whole of a smaller one): a model file's header
    (its tensors, shapes and metadata) and its last tensor's end, read in a moment however large the file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(span))
        size = f.seek(0, 2)
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return h.hexdigest()


def _fingerprint(args: EngineArgs, source: Path, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                 runner: ModelRunner, omnikv: OmniKVConfig) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and 10 hex digits of a hash of what the logits depend on besides
    the request: this build, the model's files (each one's name, size, and its first and last MiB: the same
    files copied to other hosts give the same value), the dtypes, which forward and kernels run, the
    parallel layout and OmniKV's settings. A client that pins `seed` sees it change when such a change may
    change its tokens (another build, file, flag or machine's kernels)."""
    files = [source] if source.is_file() else sorted(
        f for f in source.iterdir() if f.is_file() and f.suffix in (".gguf", ".safetensors", ".json"))
    weights = [(f.name, f.stat().st_size, _ends_digest(f)) for f in files]
    kernels: object = None
    if runner.native_forward is not None:
        import cpp_experts

        kernels = cpp_experts.info()["chosen"]
    elif device.type == "cuda":
        kernels = torch.cuda.get_device_name(device)
    what = {"build": mlaserve_version(), "torch": torch.__version__, "weights": weights, "dtype": str(dtype),
            "kv_dtype": str(kv_dtype), "device": device.type,
            "forward": "torch" if runner.native_forward is None else "native", "kernels": kernels,
            "cpu_weight_dtype": args.cpu_weight_dtype, "backends": [args.attention_backend, args.expert_backend],
            "parallel": [args.tp, args.ep, args.dp_attention], "omnikv": [args.omnikv, repr(omnikv)]}
    return "fp_" + hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:10]


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        device = torch.device(args.device)
        # tensor parallelism: this process is rank 0 of --tp (engine.ranks); the others follow its batches
        self.ranks: LeadRank | None = None
        self.dp: DPAttentionRank | None = None
        # DP attention: the engine loop calls this once per iteration on every replica (else None)
        self.step_together = self._step_together if args.dp_attention else None
        if args.tp > 1 or args.dp_attention:
            if args.tp > 1:
                self.ranks = LeadRank(args)
            else:  # this replica is one rank of the --dp replicas' model
                self.dp = DPAttentionRank(args)
            if device.type == "cpu" and args.cpu_kernels == "native":
                logger.info("CPU forward: torch ops across processes (the native forward is one process's)")
            if device.type == "cpu" and args.cpu_weight_dtype != "file":
                logger.warning("--cpu-weight-dtype %s is ignored under %s: the torch forward holds the weights in "
                               "--dtype (%s)", args.cpu_weight_dtype, "--tp" if args.tp > 1 else "--dp-attention",
                               args.dtype)
            group = self.ranks or self.dp
            device = group.device
            loaded = load_rank(args, group)
            native = False
        else:
            native = device.type == "cpu" and args.cpu_kernels == "native"
            loaded = load_model(args.model, device=device, dtype=args.dtype, expert_backend=args.expert_backend,
                                cpu_weights=args.cpu_weight_dtype if native else None, progress=False)
        self.config = cfg = loaded.config
        self.model_name = Path(str(loaded.source)).name
        tok = loaded.tokenizer
        eos = end_ids(set(cfg.eos_token_ids) | set(tok.eos_token_ids if tok else ()), cfg.vocab_size)
        self.context_len = min(args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if args.context_length and args.context_length > cfg.max_position_embeddings:
            logger.warning("--context-length %d is cut to %d, the model's own (max_position_embeddings, or YaRN's "
                           "reach: its positions are not trained past it)", args.context_length,
                           cfg.max_position_embeddings)
        if getattr(cfg, "sliding_window", None):
            logger.warning("the model's attention slides over a window of %d tokens, which is not implemented: the "
                           "context is cut to %d (within one window, sliding attention is full attention)",
                           cfg.sliding_window, cfg.max_position_embeddings)
        # auto: the model's; bf16 for GGUF blocks on the native CPU forward (executor.cpu_forward)
        kv_dtype = kv_dtype_setting(args.kv_dtype, loaded.model, loaded.dtype, device)
        per_token = kv_bytes_per_token(cfg, kv_dtype)
        # OmniKV: always planned, so that a request may ask for it whatever the server's default (under --tp
        # every rank plans alike: rank 0 sends its config, and the ranks take the selection's max over the
        # heads together, executor.distributed)
        omnikv, origin = OmniKVConfig.for_model(args.model, cfg.num_hidden_layers, args.omnikv_config)
        logger.info("OmniKV: %s for requests that do not choose; filter layers %s, budget %s, window %d (%s), "
                    "sink %d, recent %d, auto from %d tokens; config: %s", args.omnikv, list(omnikv.filter_layers),
                    omnikv.budget_tokens or f"{omnikv.budget_ratio:.0%}", omnikv.window_size, omnikv.alpha,
                    omnikv.sink_tokens, omnikv.recent_tokens, omnikv.min_context, origin)
        calibrated_on = (omnikv.calibration or {}).get("model")
        if args.omnikv_config and calibrated_on and str(calibrated_on).lower() != model_label(args.model).lower():
            logger.warning("OmniKV: %s was calibrated on %s, not on %s: its filter layers may not suit this model "
                           "(mlaserve calibrate-omnikv --model %s chooses them)", args.omnikv_config, calibrated_on,
                           model_label(args.model), args.model)
        if not omnikv.plan(cfg.num_hidden_layers).has_sparse:
            # the earliest plan (a filter at layer 0) has sparse layers unless the model is too shallow
            advice = ("choose earlier filter layers (mlaserve calibrate-omnikv)"
                      if replace(omnikv, filter_layers=(0,)).plan(cfg.num_hidden_layers).has_sparse else
                      "a model needs a filter layer, %sthen a layer to decode sparsely"
                      % ("the full layer after it (full_after_filter), " if omnikv.full_after_filter else ""))
            logger.warning("OmniKV: filter layers %s leave no layer of the %d to decode sparsely, so OmniKV "
                           "changes nothing; %s", list(omnikv.filter_layers), cfg.num_hidden_layers, advice)
        # the context bank moves the sparse layers' share of every token's KV to host memory
        bank = args.omnikv_bank
        if bank and native:
            logger.info("OmniKV context bank: off, as nothing moves on a CPU host (the native forward reads the "
                        "sparse layers in place)")
            bank = False
        host_share = sum(bank_layers(omnikv.plan(cfg.num_hidden_layers)).values(), []) if bank else []
        host_per_token = per_token * len(host_share) // cfg.num_hidden_layers
        # every engine process on this host (--dp replicas) and every --tp rank of this node keeps a bank of
        # its own (MLA: the whole latent rows on every rank), all in the one host memory
        host_procs = args.host_peers * (self.ranks.plan.per_node if self.ranks is not None else 1)
        device_per_token = per_token - host_per_token
        # from the flag, else a share of free memory less the request table's (req_to_token: an int32 KV
        # slot per running request and position, on the same device), but never more than every running
        # request can fill
        rows = args.max_running_requests + 1
        memory = available_memory(device)
        share = memory * args.mem_fraction
        slots = int((share - rows * self.context_len * 4) // device_per_token)
        if slots < self.context_len:  # then the context is cut to the slots, and the table with it: both shrink
            slots = int(share // (device_per_token + rows * 4))
        num_slots = args.max_total_tokens or min(
            max(0, slots),
            # the bank's host share: at most half the host memory available, which the processes need too,
            # shared by the processes that bank on this host
            int(available_memory(torch.device("cpu")) // 2 // host_procs // host_per_token) if host_per_token
            else args.max_running_requests * self.context_len,
            args.max_running_requests * self.context_len,
        )
        num_slots = max(args.page_size, num_slots - num_slots % args.page_size)
        if num_slots < self.context_len:  # a request longer than the cache could never finish: say so up front
            if args.max_total_tokens:
                cause = f"--max-total-tokens {args.max_total_tokens}"
            elif rows * 4 > device_per_token:  # the request table (4 bytes a request and position) took the memory
                cause = (f"--max-running-requests {args.max_running_requests}: its request table takes "
                         f"{rows * 4} bytes a position, the KV cache {device_per_token} a token")
            else:
                cause = f"--mem-fraction {args.mem_fraction:g} of {memory / 2**30:.2f} GiB available"
            if num_slots < MIN_CONTEXT:
                raise ValueError(f"the KV cache holds {num_slots} token(s) ({cause}), too few to serve any request "
                                 f"(at least {MIN_CONTEXT} are needed): change that flag (without --max-total-tokens, "
                                 "--mem-fraction sizes the cache)")
            logger.warning("context length %d is cut to %d, the KV cache's slots (%s): a longer request could "
                           "never run to its end", self.context_len, num_slots, cause)
            self.context_len = num_slots
        _warn_if_never_sparse(omnikv, self.context_len, args.omnikv)  # (the context as the cache leaves it)
        need = num_slots * (device_per_token + 8) + rows * self.context_len * 4  # (8: the slot allocator's list)
        if need > memory:  # the allocation would fail (a traceback), or succeed lazily and be killed when filled
            raise ValueError(
                f"the KV cache of {num_slots} tokens ({device_per_token} bytes each) and the request table "
                f"({args.max_running_requests} requests x {self.context_len} positions) need {need / 2**30:.1f} GiB, "
                f"more than the {memory / 2**30:.1f} GiB available: lower --max-total-tokens (or leave it out: "
                "--mem-fraction sizes the cache), --max-running-requests or --page-size")
        if bank:
            logger.info("OmniKV context bank: layers %s in host memory (%.2f GiB%s%s), %d bytes/token on the device",
                        host_share, num_slots * host_per_token / 2**30, ", pinned" if device.type == "cuda" else "",
                        f" on each of the node's {self.ranks.plan.per_node} ranks" if self.ranks is not None else "",
                        device_per_token)
        self.runner = ModelRunner(
            loaded.model, cfg, max_total_tokens=num_slots, max_running_requests=args.max_running_requests,
            max_context_len=self.context_len, device=device, kv_dtype=kv_dtype,
            attention_backend=args.attention_backend, page_size=args.page_size,
            cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph or args.tp > 1 or args.dp_attention,
            hybrid_graph_mode=args.hybrid_graph_mode,
            omnikv=omnikv, omnikv_bank=bank,
        )
        if self.ranks is not None:
            self.ranks.lead(self.runner, kv_dtype)
        if self.runner.native_forward is not None:
            # every forward is one native call on the runner's pool: torch computes only the sampling, on
            # this thread, so its OpenMP workers never compete with the pool for the cores
            torch.set_num_threads(1)
            import cpp_experts

            chosen = cpp_experts.info()["chosen"]
            logger.info("CPU forward: native (%s weights, %d threads; kernels: %s for the quantized formats, %s for "
                        "bf16)", args.cpu_weight_dtype, self.runner.expert_pool.workers.num_threads,
                        chosen["q8_0"], chosen["bf16"])
        elif native:
            logger.warning("CPU forward: torch ops, because %s", self.runner.native_off_reason)
        use_cache = not args.disable_prefix_cache
        self.cache = create_prefix_cache(use_cache, self.runner.allocator)
        self.shares_prompts = use_cache
        self.scheduler = Scheduler(
            self.runner, self.cache, Sampler(cfg.vocab_size, device), eos_token_ids=sorted(eos),
            context_len=self.context_len, max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.prefill_chunk(), max_prefill_tokens=args.prefill_budget(),
            omnikv_mode=args.omnikv, omnikv_min_context=omnikv.min_context, speculative=self._speculative(args),
            policy=args.scheduling_policy,
        )
        seed = args.seed if args.seed is not None else secrets.randbits(63)
        logger.info("requests that bring no seed draw theirs from base seed %d%s", seed,
                    "" if args.seed is not None else " (drawn at start; --seed %d repeats them)" % seed)
        self._rng = random.Random(seed)
        self.fingerprint = _fingerprint(args, loaded.source, loaded.dtype, kv_dtype, device, self.runner, omnikv)
        self.grammars = (GrammarBackend(tok.tokenizer, cfg.vocab_size, sorted(eos), timeout_s=args.grammar_compile_timeout)
                         if tok else None)
        self._compiling: list[_Compiling] = []
        self._finished_total: dict[str, int] = {}
        self.kv_bytes_per_token = per_token
        logger.info(
            "KV cache: %d slots x %d bytes/token = %.2f GiB (%s, %s); max_running_requests=%d, context_length=%d, "
            "page size %d, prefix cache %s, prefill chunks of %d tokens",
            num_slots, per_token, num_slots * per_token / 2**30, str(kv_dtype).removeprefix("torch."),
            f"MLA latent {cfg.kv_cache_dim} values x {cfg.num_hidden_layers} layers"
            if isinstance(cfg, DeepseekConfig) else f"K+V {cfg.num_key_value_heads} heads x {cfg.head_dim}",
            args.max_running_requests, self.context_len, args.page_size, "on" if use_cache else "off",
            args.prefill_chunk(),
        )

    @staticmethod
    def _speculative(args: EngineArgs) -> SpeculativeConfig | None:
        """--speculative-config's settings, or None (off)."""
        if args.speculative_config is None:
            return None
        spec = SpeculativeConfig.parse(args.speculative_config)
        logger.info("speculative decoding: %s", spec.describe())
        if args.omnikv != "off":  # (Scheduler._drafts_allowed)
            logger.warning("speculative decoding: with --omnikv %s only requests sending \"omnikv\": false get "
                           "drafts (an OmniKV completion decodes one token a step)", args.omnikv)
        return spec

    def failure(self) -> str | None:
        """Why the engine can no longer run although it is idle (a tensor-parallel rank died or froze, a
        --dp-attention replica froze), or None."""
        group = self.ranks or self.dp
        return group.failure() if group is not None else None

    def _step_together(self, stopping: bool) -> tuple[list[RequestOutput], bool]:
        """DP attention, every replica once per loop iteration: agree whether any replica has work (then
        each runs its step, or joins the others' layer exchanges with no tokens) and whether all are
        stopping. Returns the outputs and whether the loop should end."""
        assert self.dp is not None
        work, stop = self.dp.agree(self.has_work(), stopping)
        if stop or not work:
            return [], stop
        before = self.runner.forward_count
        outs = self.step() if self.has_work() else []
        if self.runner.forward_count == before:  # nothing of its own to run (or the scheduler ran nothing)
            self.runner.forward_idle()
        return outs, False

    def close(self, clean: bool = True) -> None:
        """Stops the other ranks (tensor parallelism): told to stop after a clean shutdown, else killed
        (they may be waiting in a collective this rank will never join), and the grammar compiler
        process. Idempotent."""
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.ranks is not None:
            self.ranks.close(clean)
            self.ranks = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    def describe(self) -> EngineInfo:
        return EngineInfo(
            model=self.model_name, arch=self.config.arch, vocab_size=self.config.vocab_size,
            context_length=self.context_len, kv_slots=self.runner.allocator.num_slots,
            kv_bytes_per_token=self.kv_bytes_per_token, eos_token_ids=[int(t) for t in self.scheduler.eos_token_ids],
            fingerprint=self.fingerprint,
        )

    # ------------------------------------------------------------------ the four calls
    def add_request(self, req: GenerateRequest) -> list[RequestOutput]:
        error = self._check(req)
        if error:
            code, message, param = error
            return [_refusal(req.rid, len(req.input_ids), req.arrival_time, message, code, param)]
        p = req.params
        base = p.seed if p.seed is not None else self._rng.getrandbits(63)
        # siblings wait for completion 0's prompt KV where the cache keeps some of it: a whole page (the last
        # token is always computed)
        shared = self.shares_prompts and len(req.input_ids) > self.args.page_size
        # (completion 0 alone scores a prompt whose logprobs are asked: the others take its KV from the cache)
        sibling = msgspec.structs.replace(p, prompt_logprobs=None) if p.n > 1 and p.prompt_logprobs is not None else p
        reqs = [Req(req.rid, i, list(req.input_ids), p if i == 0 else sibling, _mix_seed(base, i) if i else base,
                    arrival_time=req.arrival_time or 0.0, waits_for_sibling=i > 0 and shared)
                for i in range(p.n)]
        if p.structured is None:
            self.scheduler.add(reqs)
            return [_admitted(reqs[0])] if req.report_admission else []
        s = p.structured
        if self.grammars is None:
            return [_refusal(req.rid, len(req.input_ids), req.arrival_time, f"{s.param}: this model has no "
                             "tokenizer, so its output cannot be constrained", ERR_INVALID, s.param)]
        self._compiling.append(_Compiling(reqs, self.grammars.submit(s.kind, s.spec, s.param), req.report_admission))
        return []

    def _compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler (each completion with its own matcher);
        a grammar that failed to compile refuses its request with a 400 naming the parameter."""
        out: list[RequestOutput] = []
        if not self.scheduler.has_work():  # nothing else to run: wait a little rather than spin
            wait([c.future for c in self._compiling], timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        for c in [c for c in self._compiling if c.future.done()]:
            self._compiling.remove(c)
            first = c.reqs[0]
            try:
                compiled = c.future.result()
            except GrammarError as e:
                out.append(_refusal(first.rid, len(first.prompt_ids), first.arrival_time, e.message, ERR_INVALID, e.param))
                continue
            except Exception as e:  # the grammar engine itself failed: this request ends, the others go on
                logger.exception("compiling the grammar of request %s failed", first.rid)
                out.append(_refusal(first.rid, len(first.prompt_ids), first.arrival_time,
                                    f"the grammar engine failed: {type(e).__name__}: {e}", ERR_ENGINE))
                continue
            for r in c.reqs:
                structured = r.params.structured
                r.grammar = self.grammars.grammar(compiled, structured.after if structured else (),
                                                  structured is not None and structured.free)
            self.scheduler.add(c.reqs)
            if c.report_admission:
                out.append(_admitted(first))
        return out

    def _check(self, req: GenerateRequest) -> tuple[str, str, str | None] | None:
        """Why the request cannot run, as (error code, message, the parameter at fault or None), or None."""
        ids, p = req.input_ids, req.params
        try:
            validate_prompt_ids(ids, self.config.vocab_size)
            p.validate(self.config.vocab_size, self.scheduler.eos_token_ids)
        except ParamError as e:
            return ERR_INVALID, e.message, e.param
        if p.priority and not self.scheduler.by_priority:
            return ERR_INVALID, (f"priority {p.priority} needs a server started with --scheduling-policy priority "
                                 "(this one admits requests in arrival order); leave priority out or at 0"), "priority"
        want = len(ids) + (1 if p.max_tokens is None else p.max_tokens)
        if want > self.context_len:
            return ERR_CONTEXT, context_message(self.context_len, len(ids), want - len(ids)), None
        if len(ids) + (p.max_tokens != 0) > self.runner.allocator.num_slots:  # (max_tokens 0: scored only)
            return ERR_CONTEXT, f"the prompt ({len(ids)} tokens) does not fit in the KV cache ({self.runner.allocator.num_slots} slots)", None
        # Admission: up to max_running_requests completions run and max_queued_requests more wait; a
        # request counts as its n completions, wherever they are now (both queues are checked, so a
        # burst that arrives before the next step is admitted exactly as a steady stream would be).
        admitted = len(self.scheduler.running) + len(self.scheduler.waiting) + sum(len(c.reqs) for c in self._compiling)
        capacity = self.args.max_running_requests + self.args.max_queued_requests
        if p.n > capacity:  # never admissible, however long the client waits: not a retryable 503
            return ERR_INVALID, (
                f"n={p.n} completions can never be admitted: this server holds at most {capacity} at once "
                f"(--max-running-requests {self.args.max_running_requests} + --max-queued-requests "
                f"{self.args.max_queued_requests}); ask for n <= {capacity}, or send several requests"), "n"
        if admitted + p.n > capacity:
            return ERR_OVERLOADED, overloaded_message(admitted, self.args.max_running_requests,
                                                      self.args.max_queued_requests, p.n), None
        return None

    def abort(self, rid: str, index: int | None = None) -> list[RequestOutput]:
        """Ends `rid`'s completions (completion `index` alone, when given) with `abort`."""
        # (a completion alone is ended once it has written text, so never while its grammar compiles)
        compiling = [c for c in self._compiling if c.reqs[0].rid == rid and index is None]
        for c in compiling:  # not in the scheduler yet: it ends here
            self._compiling.remove(c)
            c.future.cancel()
            for r in c.reqs:
                r.finish_reason = FINISH_ABORT
        return self._outputs([r for c in compiling for r in c.reqs] + self.scheduler.abort(rid, index))

    def step(self) -> list[RequestOutput]:
        ready = self._compiled() if self._compiling else []
        if any(o.admitted for o in ready):  # told before the step that runs them (its first prefill chunk may be
            return ready  # long): a stream's headers go now; the loop steps again at once
        return ready + self._outputs(self.scheduler.step() if self.scheduler.has_work() else [])

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling)

    def stats(self, request_id: int = 0) -> EngineStats:
        s, c, o = self.scheduler, self.scheduler.counters, self.runner.omnikv_counters
        ranks = self.ranks.plan.world if self.ranks is not None else 1
        return EngineStats(
            request_id=request_id, num_running=len(s.running),
            num_waiting=len(s.waiting) + sum(len(c.reqs) for c in self._compiling),  # (their grammars compile)
            kv_slots_used=s.kv_slots_used(), kv_slots_total=self.runner.allocator.num_slots,
            prefix_cache_slots=self.cache.evictable_size(),
            prefix_cache_hit_tokens_total=c.prefix_cache_hit_tokens,
            prefix_cache_query_tokens_total=c.prefix_cache_query_tokens, prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens, retractions_total=c.retractions,
            aborted_total=c.aborted, forward_steps_total=c.forward_steps, forward_seconds_total=c.forward_seconds,
            finished_total=dict(self._finished_total),
            omnikv_sparse_tokens_total=o.sparse_tokens, omnikv_selected_tokens_total=o.selected_tokens,
            omnikv_context_tokens_total=o.context_tokens,
            # every --tp rank banks and gathers as rank 0 does (the same slots, selections and bytes a token:
            # MLA's whole latent row, or the rank's KV heads, as many on each)
            omnikv_bank_host_bytes=s.kv_slots_used() * self.runner.kv_pool.host_bytes_per_token() * ranks,
            omnikv_bank_gathered_bytes_total=bank.bytes_gathered * ranks if (bank := self.runner.context_bank) else 0,
            spec_decode_drafts_total=c.spec_drafts, spec_decode_draft_tokens_total=c.spec_draft_tokens,
            spec_decode_accepted_tokens_total=c.spec_accepted_tokens,
        )

    def _outputs(self, reqs: list[Req]) -> list[RequestOutput]:
        out = []
        for r in reqs:
            prompt_logprobs = None
            if r.prompt_logprobs is not None and not r.prompt_logprobs_sent and not r.scores_prompt:  # complete
                prompt_logprobs, r.prompt_logprobs_sent = r.prompt_logprobs, True
            predicted = r.proposer if isinstance(r.proposer, PredictionProposer) else None
            out.append(RequestOutput(
                r.rid, r.index, r.pending_ids, logprobs=r.pending_logprobs or None, finish_reason=r.finish_reason,
                prompt_logprobs=prompt_logprobs,
                prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
                accepted_prediction_tokens=predicted.kept if predicted else 0,
                rejected_prediction_tokens=predicted.rejected if predicted else 0,
                arrival_time=r.arrival_time, first_scheduled_time=r.first_scheduled_time,
                first_token_time=r.first_token_time,
            ))
            r.pending_ids, r.pending_logprobs = [], []
            if r.finish_reason:
                self._finished_total[r.finish_reason] = self._finished_total.get(r.finish_reason, 0) + 1
        return out
