"""`EngineArgs`: every setting of the engine, settled once at start-up and passed down.

Each field that a user sets carries its command-line flag in its metadata (`flag(...)`: help, choices,
how a string becomes the value, what range is valid); a field nobody sets is marked `internal(...)` with
the reason, so a forgotten flag is a test failure rather than a silent default. `server.args` builds
`mlaserve serve`'s flags and `MLASERVE_*` variables from these fields, and `mlaserve generate` its engine
flags: a default, a choice list or a range lives here once. Torch-free and plain data: it is pickled to
the engine process (the specs live on the class's fields, not on instances).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from models.builtin import DEFAULT_MODEL
from models.omnikv_config import OMNIKV_MODES, OmniKVConfig
from scheduler.speculative import speculative_json

# Choice lists. Their torch-side twins (models.loader.load.DTYPES, kernels.attention.BACKENDS,
# models.experts.EXPERT_BACKENDS, executor.cuda_graph_runner.HYBRID_GRAPH_MODES,
# models.native.CPU_WEIGHT_DTYPES) cannot be imported here
# without torch; tests/server/test_args.py keeps them equal.
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")
EXPERT_BACKENDS = ("torch", "cpp", "triton")
HYBRID_GRAPH_MODES = ("host-nodes", "split")
SCHEDULING_POLICIES = ("fcfs", "priority")  # scheduler.Scheduler's `policy`
CPU_KERNELS = ("native", "torch")
CPU_WEIGHT_DTYPES = ("file", "bf16", "float32", "q8_0")

Check = Callable[[Any], "str | None"]  # the problem with a parsed value ("must be > 0"), or None


@dataclass(frozen=True)
class FlagSpec:
    """How a settings field appears on the command line (`--<name>`) and in the environment."""

    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # None: from the field's type (str, int, float, bool)
    check: Check | None = None
    name: str | None = None  # default: the field name, "_" -> "-"
    metavar: str | None = None  # default: N (int), X (float), BOOL, {choices} or the name in capitals
    default_text: str | None = None  # how --help states a default that is derived later (a None field)


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None,
         check: Check | None = None, name: str | None = None, metavar: str | None = None,
         default_text: str | None = None) -> Any:
    """A dataclass field with a default that is also a command-line flag and an `MLASERVE_*` variable."""
    spec = FlagSpec(help, choices, parse, check, name, metavar, default_text)
    return dataclasses.field(default=default, metadata={"flag": spec})


def internal(why: str, *, default: Any = dataclasses.MISSING,
             default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A settings field that is deliberately not a flag (derived from others, or nested); `why` says so."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"internal": why})


def positive(value: int | float | None) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def non_negative(value: int | float | None) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def fraction(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


def non_empty(value: str) -> str | None:
    # an empty MLASERVE_MODEL would otherwise be the current directory, found only after the port is bound
    return None if value.strip() else "must not be empty"


def omnikv_file(value: str | None) -> str | None:
    """A config file that reads as an OmniKV config (checked before anything starts)."""
    if value is None:
        return None
    try:
        OmniKVConfig.load(value)
    except ValueError as err:
        return str(err)
    return None


def port_or_zero(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a TCP port (0-65535)"


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now: what `--master-port 0` becomes for a one-machine rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


CPU_PREFILL_CHUNK = 512  # a step of the default model at 2 threads: ~0.15 s of prompt at most
GPU_PREFILL_CHUNK = 2048
GPU_PREFILL_BUDGET = 8192  # a GPU step takes several requests' chunks: prefill is cheap next to its decode


def device_name(value: str) -> str | None:
    kind, _, index = value.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return None
    return "must be cpu, cuda or cuda:N"


#: The fewest KV slots the engine starts with: a cache cut below it (a tiny --max-total-tokens, a request
#: table that took the memory) could not hold a chat template's prompt, and every request would be refused.
MIN_CONTEXT = 32


def context_length_value(value: int | None) -> str | None:
    """--context-length: at least MIN_CONTEXT (a context of 1 was taken, and no chat prompt fit in it)."""
    return None if value is None or value >= MIN_CONTEXT else f"must be at least {MIN_CONTEXT}"


@dataclass(frozen=True)
class EngineArgs:
    model: str = flag(DEFAULT_MODEL, "built-in model name, HF directory or .gguf file", check=non_empty,
                      metavar="MODEL")
    device: str = flag("cpu", "cpu or cuda[:N]", check=device_name, metavar="DEVICE")
    dtype: str = flag("auto", "weights and activations dtype (auto: bfloat16 where the hardware does bf16 "
                      "math, else float32 on CPU, float16 on CUDA)", choices=DTYPES)
    kv_dtype: str = flag("auto", "KV cache dtype (auto: the model's; bfloat16 where --cpu-kernels native runs "
                         "quantized GGUF weights, as llama.cpp keeps f16)", choices=DTYPES)
    attention_backend: str = flag("torch", "attention implementation (triton: split-KV MLA decode and extend "
                                  "kernels for CUDA, with CUDA-graph decode)", choices=ATTENTION_BACKENDS)
    expert_backend: str = flag("torch", "routed-expert implementation for MoE models (cpp: the C++ CPU pool; GGUF "
                               "blocks stay quantized; triton: fused-MoE kernel on the GPU); ignored by dense models, "
                               "and on the CPU with --cpu-kernels native, whose experts always run in the cpp pool",
                               choices=EXPERT_BACKENDS)
    cpu_kernels: str = flag("native", "how --device cpu computes: native (one C++ call per batch: GGUF weights kept "
                            "in their block types, fused layers, one thread pool) or torch (torch ops on weights "
                            "dequantized to --dtype: the reference)", choices=CPU_KERNELS)
    cpu_weight_dtype: str = flag("file", "with --cpu-kernels native, how weights are held: file (GGUF blocks as "
                                 "stored, fp32/fp16 tensors as fp32, bf16 as bf16), bf16 (every weight bf16, "
                                 "activations never rounded to int8), float32 (every weight fp32, routed experts "
                                 "and norms too, with --dtype auto meaning float32: exact) or q8_0 (float weights "
                                 "quantized to Q8_0 as they load, as llama.cpp's Q8_0 files hold them: about half "
                                 "a bf16 checkpoint's memory and read; quantized blocks as file keeps them)",
                                 choices=CPU_WEIGHT_DTYPES)
    context_length: int | None = flag(None, "maximum prompt + completion tokens", check=context_length_value,
                                      default_text="the model's")
    max_running_requests: int = flag(64, "requests decoded together at most", check=positive)
    max_queued_requests: int = flag(1024, "waiting requests beyond which new ones get 503 overloaded (0: refuse "
                                    "whatever cannot run at once)", check=non_negative)
    max_total_tokens: int | None = flag(None, "KV cache size in tokens", check=positive,
                                        default_text="--mem-fraction of free memory")
    mem_fraction: float = flag(0.3, "share of free memory for the KV cache when --max-total-tokens is "
                               "unset (on a CPU: the RAM available to the process, within a container's limit; "
                               "each --dp replica takes 1/N of it)", check=fraction, metavar="FRACTION")
    chunked_prefill_size: int | None = flag(None, "most prompt tokens prefilled per request per step. On a CPU it is "
                                            "also a step's whole prefill work, so running streams wait for one chunk "
                                            "at most; on a GPU a step takes chunks of several requests, up to 8192 "
                                            "tokens", check=positive, default_text="512 on a CPU, 2048 on a GPU")
    max_prefill_tokens: int | None = internal("the token budget of one step's prefill work (None: `prefill_budget`)",
                                              default=None)
    page_size: int = flag(1, "KV slots per page (64 for paged attention kernels; the prefix cache then "
                          "shares whole pages)",
                          check=positive)
    cuda_graph_max_bs: int = flag(64, "largest decode batch run through a captured CUDA graph (CUDA, triton "
                                  "attention and, for MoE models, triton or cpp experts); larger ones run eagerly",
                                  check=non_negative)
    disable_cuda_graph: bool = flag(False, "run every decode eagerly (no CUDA graphs)")
    hybrid_graph_mode: str = flag("host-nodes", "how --expert-backend cpp on a GPU enters decode graphs: host-nodes "
                                  "(the CPU work as host nodes of one graph) or split (graph pieces with the CPU "
                                  "work run between them)", choices=HYBRID_GRAPH_MODES)
    disable_prefix_cache: bool = flag(False, "turn the radix prefix cache off")
    scheduling_policy: str = flag("fcfs", "the order waiting requests are admitted in: fcfs (arrival), or priority "
                                  "(a request's `priority`, lower first, then arrival, as vLLM's; when KV runs short "
                                  "the lowest-priority running request gives its KV back first)",
                                  choices=SCHEDULING_POLICIES)
    seed: int | None = flag(None, "base seed of the requests that bring none: by default drawn at each start "
                            "(and logged), so that their draws differ across restarts as OpenAI's, llama.cpp's and "
                            "SGLang's do; give one to repeat them", default_text="random")
    watchdog_timeout: float = flag(300.0, "seconds one engine step (a batch's forward and sampling) may run: a step "
                                   "running longer ends the engine, so that its requests fail with engine_error and "
                                   "/health reports it instead of hanging (a hung device, a deadlock); 0: no limit",
                                   check=non_negative, metavar="SECONDS")
    startup_timeout: float = flag(600.0, "seconds the engine may take to start (load the model, on a GPU capture "
                                  "its CUDA graphs, and report ready): a longer start, or an engine frozen while "
                                  "loading, ends the server with an error; raise it for large models on slow "
                                  "disks; 0: no limit", check=non_negative, metavar="SECONDS")
    grammar_compile_timeout: float = flag(30.0, "seconds one structured-output spec (JSON schema, regex, grammar) "
                                          "may take to compile: a longer compile is stopped and its request refused "
                                          "with a 400 (a few small specs take minutes); 0: no limit",
                                          check=non_negative, metavar="SECONDS")
    rank_timeout: float = flag(15.0, "seconds a --tp rank or --dp-attention replica may show no sign of life (a "
                               "stopped process, a frozen host) before the engine reports it as crashed and its "
                               "requests fail; raise it where hosts pause for longer", check=positive,
                               metavar="SECONDS")
    tp: int = flag(1, "tensor-parallel size: processes that each hold 1/N of the weights (heads, MLP and experts "
                   "split, vocabulary split) and run every batch together over torch.distributed (gloo on CPU, "
                   "NCCL with one GPU per rank); the torch forward on CPU", check=positive, metavar="N")
    ep: int = flag(1, "expert parallelism for MoE models: 1 (each routed expert split over the --tp ranks) or the "
                   "--tp size (whole routed experts partitioned over the ranks)", check=positive, metavar="N")
    nnodes: int = flag(1, "machines the --tp ranks are spread over (--tp / --nnodes ranks each)", check=positive,
                       metavar="N")
    node_rank: int = flag(0, "this machine's index among --nnodes: 0 serves HTTP and hosts rank 0; the others "
                          "only run their ranks", check=non_negative, metavar="K")
    master_addr: str = flag("127.0.0.1", "address of node 0 (its rank 0 hosts the rendezvous)", check=non_empty,
                            metavar="HOST")
    master_port: int = flag(0, "rendezvous port on --master-addr (0: a free port, one node only)", check=port_or_zero,
                            metavar="PORT")
    dp_attention: bool = flag(False, "with --dp N: the N replicas are the ranks of one model whose MLP/MoE layers "
                              "are split over them (--ep N: whole experts partitioned), while each runs attention "
                              "for its own requests with its own KV cache (an MLA latent cache is then not "
                              "replicated N times); the replicas step together")
    dp_rank: int = internal("this replica's index under --dp-attention: set by the server per replica", default=0)
    dp_size: int = internal("the replicas under --dp-attention (the server's --dp): set by the server", default=1)
    host_peers: int = internal("engine processes on this host, this one included (the server's --dp replicas): "
                               "they share its memory, the OmniKV context bank's host share among them; set by the "
                               "server", default=1)
    omnikv: str = flag("off", "OmniKV sparse attention at decode for requests that do not choose (their `omnikv` "
                       "field): on, off, or auto (contexts of at least the config's min_context tokens)",
                       choices=OMNIKV_MODES)
    omnikv_bank: bool = flag(False, "OmniKV's context bank: after prefill the KV of OmniKV's sparse layers lives in "
                             "host memory (pinned on a GPU), and each decode step's filter layers gather the selected "
                             "rows to the device, so the device holds only the other layers' KV per token. On a CPU "
                             "host nothing moves: with the native CPU forward it is ignored, with --cpu-kernels torch "
                             "it runs the same path in host memory")
    omnikv_config: str | None = flag(None, "OmniKV settings (filter layers, budget, window; written by mlaserve "
                                     "calibrate-omnikv)", check=omnikv_file, metavar="FILE",
                                     default_text="the calibrated one shipped for the model, else filter layers at "
                                     "1/5 and 1/2 of the depth")

    speculative_config: str | None = flag(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": B} (n-gram lookup in the "
        "completion's own prompt and output proposes tokens, one forward verifies them; the tokens are those "
        "decoding without it gives, at any temperature; under a structured output a draft is cut where the grammar "
        "refuses it). Not with OmniKV (it decodes one token a step)", check=speculative_json, metavar="JSON", default_text="off")

    def prefill_chunk(self) -> int:
        """The prefill chunk: --chunked-prefill-size, else CPU_PREFILL_CHUNK on a CPU and GPU_PREFILL_CHUNK on a GPU."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return GPU_PREFILL_CHUNK if self.device.startswith("cuda") else CPU_PREFILL_CHUNK

    def prefill_budget(self) -> int:
        """The prompt tokens one step prefills at most (several requests' chunks). On a CPU one chunk: a step's
        time grows with its tokens, and every running stream waits for the step (a 6K-token prompt of 2048-token
        chunks in a budget of 8192 stalled the other streams of the default model on 2 cores for seconds,
        while 256-token chunks barely lengthened the prompt's own prefill). On a GPU, GPU_PREFILL_BUDGET."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        chunk = self.prefill_chunk()
        return max(chunk, GPU_PREFILL_BUDGET) if self.device.startswith("cuda") else chunk


LOG_LEVEL_ENV = "MLASERVE_LOG_LEVEL"  # --log-level's variable: how the server's level reaches the processes it starts


def use_log_level(level: str) -> None:
    """This process logs at --log-level `level`, and leaves it in LOG_LEVEL_ENV for the processes it starts
    (the engine process, the ranks: `engine_log_level`)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ[LOG_LEVEL_ENV] = level


def engine_log_level(environ: Mapping[str, str]) -> int:
    """The logging level of the engine process and the ranks: the server's --log-level, which the server
    leaves in LOG_LEVEL_ENV for the processes it starts (INFO where unset or unknown)."""
    level = logging.getLevelName(environ.get(LOG_LEVEL_ENV, "info").upper())
    return level if isinstance(level, int) else logging.INFO
