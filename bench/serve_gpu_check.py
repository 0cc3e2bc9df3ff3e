"""End-to-end check of `mlaserve serve --device cuda` on a GPU host: the HTTP server, the engine process,
the Triton attention and expert backends and CUDA-graph decode, on a random tiny DeepSeek-V2 checkpoint
(MLA + MoE) written here, against the same checkpoint served on the CPU.

What it does: writes the checkpoint (fp32), starts one server on the GPU and one on the CPU
(`--cpu-weight-dtype float32`, exact), sends the same greedy `/v1/completions` to both (16 at once, so
the GPU server batches them and replays its decode graphs), one streaming request, a bad request (must
be a 4xx in OpenAI's error shape, and the server must keep serving), and reads `/metrics`. Greedy
token agreement between the GPU and the CPU is reported (fp32 both sides, different summation orders:
near-ties can flip a token, after which the two texts differ): every request must agree with the CPU's
up to its first divergence, and there the GPU's token must lie within 0.01 nats of the CPU's best.
Both servers run fp32 weights, activations and KV cache (`--dtype float32`): served in bf16 (the
default), the H200's first divergences lay 0.0003 to 0.094 nats below the CPU's best, bf16 rounding
of different fp32 sums, too wide a band to tell a near-tie from a small error. Exits 1 when a request fails, the error shape is wrong or agreement is low.

    python bench/serve_gpu_check.py [--out bench/results/serve_gpu_check_<device>.json]
    python bench/serve_gpu_check.py --smoke --out /tmp/serve.json   # no GPU: the torch reference on the CPU
                                                                    # stands in for the GPU server (tests)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# the repository first, and bench/ for the helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cpu_common import RESULTS, free_port  # noqa: E402
from models.synthetic import write_checkpoint  # noqa: E402
from serve_cpu import Server, mlaserve_command, start_server, stop_server  # noqa: E402

TOP_LOGPROBS = 5
TIE_NATS = 0.01  # a first divergence within this of the reference's best is a summation-order near-tie (fp32)
PROMPTS = [f"request {i}: the {w} of" for i, w in enumerate(
    "river mountain city engine model kernel graph token cache layer expert router latent head batch stream".split())]


def server(name: str, model: Path, *args: str) -> Server:
    port = free_port()
    return Server(name, mlaserve_command(str(model), port, ["--served-model-name", "tiny", *args]),
                  f"http://127.0.0.1:{port}")


def complete(url: str, prompt: str, max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    r = httpx.post(url + "/v1/completions", timeout=120, json=body)
    r.raise_for_status()
    return r.json()


def first_divergence(test: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any] | None:
    """Where two greedy completions (with `logprobs`) first pick different tokens, and how far the test's
    pick lies below the reference's best there, in the reference's own logprobs (inf when the pick is
    not among its top ones); None when they agree throughout. Up to that token both saw the same
    context, so a small gap is a near-tie that summation order flipped, a large one a wrong model."""
    a, b = test["choices"][0]["logprobs"], ref["choices"][0]["logprobs"]
    for j, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        if ta != tb:
            top = b["top_logprobs"][j] or {}
            gap = max(top.values()) - top[ta] if ta in top else float("inf")
            return {"token": j, "test": ta, "ref": tb, "gap_nats": gap}
    return None


def batch(url: str, max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        out = list(ex.map(lambda p: complete(url, p, max_tokens, logprobs=TOP_LOGPROBS), PROMPTS))
    return out, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="tiny-deepseek-v2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="no GPU: serve the torch reference on the CPU in its place")
    args = ap.parse_args()
    import torch

    if args.smoke:
        device, under_test = "cpu (smoke)", ["--device", "cpu", "--cpu-kernels", "torch", "--dtype", "float32"]
    elif torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        under_test = ["--device", "cuda", "--dtype", "float32", "--attention-backend", "triton",
                      "--expert-backend", "triton", "--cuda-graph-max-bs", "16"]
    else:
        raise SystemExit("no CUDA device: this check needs a GPU (--smoke runs its CPU stand-in)")
    slug = device.lower().replace(" ", "_")
    out_path = Path(args.out) if args.out else RESULTS / f"serve_gpu_check_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serve_gpu_check_"))
    model = write_checkpoint(work / "model", args.preset, seed=3, dtype="float32")
    result: dict[str, Any] = {"preset": args.preset, "device": device, "smoke": args.smoke, "failures": []}
    servers = {  # "cuda": the server under test (the GPU one, or its stand-in with --smoke)
        "cuda": server("serve_gpu_check.cuda", model, *under_test),
        "cpu": server("serve_gpu_check.cpu", model, "--device", "cpu", "--dtype", "float32", "--cpu-weight-dtype", "float32"),
    }
    try:
        for name, s in servers.items():
            t0 = time.monotonic()
            start_server(s, out_path.parent, 600)  # logs beside the result
            result[f"{name}_startup_s"] = time.monotonic() - t0
        texts, answers = {}, {}
        for name, s in servers.items():
            batch(s.url, 4)  # warm-up
            outs, secs = batch(s.url, args.max_tokens)
            answers[name] = outs
            texts[name] = [o["choices"][0]["text"] for o in outs]
            result[f"{name}_batch_s"] = secs
            result[f"{name}_finish"] = sorted({o["choices"][0]["finish_reason"] for o in outs})
            result[f"{name}_completion_tokens"] = sum(o["usage"]["completion_tokens"] for o in outs)
        # A random tiny model's logits are flat over a 129k vocabulary, so near-ties are common and one
        # flipped by summation order changes the rest of the text: every request must agree up to its
        # first divergence, and that divergence must be a near-tie under the CPU's logprobs.
        agree = sum(a == b for a, b in zip(texts["cuda"], texts["cpu"]))
        splits = [first_divergence(a, b) for a, b in zip(answers["cuda"], answers["cpu"])]
        result["greedy_agreement"] = f"{agree}/{len(PROMPTS)}"
        result["first_divergences"] = [d for d in splits if d is not None]
        result["examples"] = {"cuda": texts["cuda"][:3], "cpu": texts["cpu"][:3]}
        wide = [d for d in splits if d is not None and d["gap_nats"] > TIE_NATS]
        if wide:
            result["failures"].append(f"{len(wide)} of {len(PROMPTS)} requests part from the CPU's greedy tokens "
                                      f"where it was no near-tie (>{TIE_NATS} nats): {wide[:3]}")
        gpu = servers["cuda"].url
        with httpx.stream("POST", gpu + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
        streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks if c != "data: [DONE]")
        result["stream_equals_plain"] = streamed == texts["cuda"][0]
        if not (chunks and chunks[-1] == "data: [DONE]" and streamed == texts["cuda"][0]):
            result["failures"].append("streamed text differs from the non-streamed one")
        bad = httpx.post(gpu + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": -3})
        err = bad.json().get("error", {})
        result["bad_request"] = {"status": bad.status_code, "error": err}
        if not (400 <= bad.status_code < 500 and {"message", "type", "param", "code"} <= set(err)):
            result["failures"].append(f"bad request answered {bad.status_code} {bad.text[:200]}")
        again = complete(gpu, PROMPTS[1], args.max_tokens)["choices"][0]["text"]
        if again != texts["cuda"][1]:
            result["failures"].append("the same greedy request gave another text after the bad one")
        metrics = httpx.get(gpu + "/metrics", timeout=10).text
        result["metrics_lines"] = len(metrics.splitlines())
    except (Exception, SystemExit) as e:  # reported in the JSON, with the servers' logs beside it
        result["failures"].append(f"{type(e).__name__}: {e}")
    finally:
        for s in servers.values():
            stop_server(s)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
