"""GPTQ, AWQ and compressed-tensors checkpoints (integer weight-only quantization).

The files are written here from fresh random tiny models (`models.loader.int_quant_writer`: each linear weight
rounded to a grid of its group's scale and zero point; any codes with any scales are a valid file, and the
writer is not under test). Its `value` is the format's definition, `scale * (code - zero)`; the readers that
check ours are other people's:

- llama.cpp's converter (`conversion/base.py`'s `dequant_model`, in the sources `make test` unpacks) for GPTQ
  and compressed-tensors, run in a subprocess with its own `gguf` package;
- AutoAWQ's `dequantize_gemm` (its `packing_utils.py`, fetched by `make test`) for AWQ;
- compressed-tensors' own packer writes those files, and transformers (through compressed-tensors) reads
  them back into a model whose logits ours must match;
- transformers' forward on the defined values for the model-level checks of every format.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench import peers
from models.experts import CppExperts
from models.loader.errors import CheckpointError
from models.loader.gguf_writer import write_gguf
from models.loader.int_quant_writer import write_awq, write_compressed_tensors, write_gptq
from models.loader.load import load_model
from models.loader.raw_blocks import RawBlocks
from models.loader.safetensors_loader import HFCheckpoint
from models.loader.shard import Shard
from models.native import NativeLinear
from models.synthetic import write_checkpoint
from mlaserve.cli import main
from tests.hf_models import build_hf_model
from tests.models.test_fp8_checkpoints import _broken, _fails, served_greedy
from tests.models.test_hf_parity import make_runner, prefill_logits, prompt, rel_err

ROOT = Path(__file__).resolve().parents[2]
AUTOAWQ = next(iter(sorted((ROOT / ".venv" / "oracles").glob("autoawq-*/awq/utils/packing_utils.py"))), None)


WRITERS = {
    "gptq4_sym": lambda d: write_gptq(d, 4, 32, symmetric=True),
    "gptq4_asym_v2": lambda d: write_gptq(d, 4, 32, symmetric=False, v2=True),
    "gptq4_asym_v1": lambda d: write_gptq(d, 4, 64, symmetric=False),
    "gptq8_sym_channel": lambda d: write_gptq(d, 8, -1, symmetric=True),
    "gptq4_act_order": lambda d: write_gptq(d, 4, 32, symmetric=True, act_order=True, seed=5),
    "awq": lambda d: write_awq(d, 32),
    "ct4_sym": lambda d: write_compressed_tensors(d, 4, 32, symmetric=True),
    "ct4_asym": lambda d: write_compressed_tensors(d, 4, 32, symmetric=False),
    "ct8_channel": lambda d: write_compressed_tensors(d, 8, None, symmetric=True),
    "ct_int8": lambda d: write_compressed_tensors(d, 8, None, symmetric=True, fmt="int-quantized"),
}
# the block type the CPU kernels get for a 32-column-aligned weight (None: dequantized)
BLOCKS = {"gptq4_sym": "Q4_0", "gptq4_asym_v2": "Q5_0", "gptq4_asym_v1": "Q5_0", "gptq8_sym_channel": "Q8_0",
          "gptq4_act_order": None, "awq": "Q5_0", "ct4_sym": "Q4_0", "ct4_asym": "Q5_0", "ct8_channel": "Q8_0",
          "ct_int8": "Q8_0"}


# ----------------------------------------------------------------------------- oracles

LLAMA_CPP_DEQUANT = """
import json, sys, types
from pathlib import Path
src, ckpt, dst = (Path(a) for a in sys.argv[1:])
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion.base import ModelBase
from safetensors.torch import load_file, save_file
tensors = load_file(ckpt / "model.safetensors")
me = types.SimpleNamespace(hparams=json.loads((ckpt / "config.json").read_text()), lazy=False, _is_nvfp4=False,
                           _fp8_as_q8=False, _fp8_dequantized=set(),
                           model_tensors={n: (lambda t=t: t) for n, t in tensors.items()})
ModelBase.dequant_model(me)
save_file({n: f().float().contiguous() for n, f in me.model_tensors.items()}, dst)
"""


def llama_cpp_dequantized(d: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """llama.cpp's converter's reading of checkpoint `d`, every tensor fp32 (its own process: it brings its
    own `gguf` package)."""
    src = peers.convert_script()
    if src is None:
        pytest.skip("llama.cpp's sources are not unpacked (`make test` does it: bench/peers.py unpack)")
    script = tmp_path / "dequant.py"
    script.write_text(LLAMA_CPP_DEQUANT)
    dst = tmp_path / "llama_cpp.safetensors"
    proc = subprocess.run([sys.executable, str(script), str(src.parent), str(d), str(dst)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(dst)


def autoawq_dequantize():
    """AutoAWQ's `dequantize_gemm(qweight, qzeros, scales, bits, group_size)` -> fp16 [in, out]."""
    if AUTOAWQ is None:
        pytest.skip("AutoAWQ's packing_utils.py is not fetched (`make test` does it into .venv/oracles)")
    spec = importlib.util.spec_from_file_location("autoawq_packing_utils", AUTOAWQ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dequantize_gemm


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("case", list(WRITERS))
def test_weights_read_as_the_format_defines(tmp_path, case):
    """Every quantized weight, dequantized, is `scale * (code - zero)` exactly; as ggml blocks for the CPU's
    kernels it is the expected block type (Q4_0 symmetric 4-bit, Q5_0 4-bit with zero points, Q8_0 8-bit),
    decoding to the same values, and dequantized where no block type holds it (act order's scattered
    groups; DeepSeek's 40-column down projections are no whole 32-column blocks)."""
    build_hf_model("v2_lite_yarn_grouped" if case.startswith("gptq4_s") else "llama_gqa_tied",
                   seed=41).save_pretrained(tmp_path)
    want = WRITERS[case](tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    layout = ckpt.layout()
    assert set(want) <= set(layout)
    assert not any(n.endswith((".qweight", ".scales", "_packed", "_scale", "_shape", ".g_idx")) for n in layout)
    for name, w in want.items():
        assert layout[name] == tuple(w.shape), name
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, w), name
        raw = ckpt.get_raw(name)
        if BLOCKS[case] is None or w.shape[1] % 32:
            assert isinstance(raw, torch.Tensor) and torch.equal(raw, w), name
        else:
            assert isinstance(raw, RawBlocks) and raw.qtype.name == BLOCKS[case], (name, raw)
            assert torch.equal(raw.dequantize(), w), name


@pytest.mark.parametrize("case", [c for c in WRITERS if c not in ("awq", "ct8_channel")])
def test_llama_cpp_converter_reads_the_same_weights(tmp_path, case):
    """llama.cpp's converter dequantizes each weight to the same fp32 values (GPTQ and compressed-tensors;
    it reads no AWQ, nor packed per-channel scales: transformers checks those below)."""
    d = tmp_path / "ckpt"
    build_hf_model("llama_gqa_tied", seed=42).save_pretrained(d)
    want = WRITERS[case](d)
    theirs = llama_cpp_dequantized(d, tmp_path)
    ckpt = HFCheckpoint(d)
    for name in want:
        assert torch.equal(ckpt.get(name), theirs[name]), name


def test_autoawq_reads_the_same_weights(tmp_path):
    """AutoAWQ's own unpacking (fp16, as its kernels compute) gives each weight our values, rounded to fp16."""
    dequantize_gemm = autoawq_dequantize()
    build_hf_model("llama_gqa_tied", seed=43).save_pretrained(tmp_path)
    want = write_awq(tmp_path, 32)
    stored = load_file(tmp_path / "model.safetensors")
    ckpt = HFCheckpoint(tmp_path)
    for name in want:
        base = name[: -len(".weight")]
        theirs = dequantize_gemm(stored[base + ".qweight"], stored[base + ".qzeros"], stored[base + ".scales"], 4, 32)
        assert torch.equal(ckpt.get(name).half(), theirs.t()), name


# ----------------------------------------------------------------------------- models


def _hf_with(d: Path, weights: dict[str, torch.Tensor]):
    """transformers' model of unquantized directory `d` with `weights` in place of its own (written to the
    file and loaded by transformers, which stacks a MoE's per-expert tensors its own way)."""
    from transformers import AutoModelForCausalLM

    state = load_file(d / "model.safetensors")
    assert set(weights) <= set(state)
    save_file(state | {n: w.contiguous() for n, w in weights.items()}, d / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("case, name", [("gptq4_sym", "llama_gqa_tied"), ("awq", "llama_rope3_untied"),
                                        ("ct4_asym", "llama_gqa_tied"), ("gptq4_act_order", "llama_gqa_tied"),
                                        ("gptq4_sym", "v2_lite_yarn_grouped"), ("ct_int8", "v3_noaux_yarn"),
                                        ("gptq4_sym", "mixtral")])
def test_quantized_model_matches_transformers(tmp_path, case, name):
    """Our forward on the quantized directory against transformers' on the weights it defines: the torch
    model and the native CPU forward in fp32 match it; the native forward on the file's own blocks
    (`--cpu-weight-dtype file`, the default) holds the block types above and stays as close as 8-bit
    activations allow."""
    d, unquantized = tmp_path / "q", tmp_path / "ref"
    build_hf_model(name, seed=44).save_pretrained(d)
    shutil.copytree(d, unquantized)
    want = WRITERS[case](d)
    hf = _hf_with(unquantized, want)
    ids = prompt(40, hf.config.vocab_size, seed=9)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for cpu_weights in (None, "float32"):
        ours = prefill_logits(make_runner(d, cpu_weights=cpu_weights), ids)
        assert rel_err(ours, ref) <= 1e-4, cpu_weights
    blocks = make_runner(d, cpu_weights="file")
    formats = {n: m.op.weight_format for n, m in blocks.model.named_modules() if isinstance(m, NativeLinear)}
    blocked = {n[: -len(".weight")]: BLOCKS[case] and want[n].shape[1] % 32 == 0 for n in want}
    held = {n: formats[n] for n in blocked if n in formats}
    assert held and all(f == (BLOCKS[case].lower() if blocked[n] else "f32") for n, f in held.items()), held
    assert any(blocked.values()) or BLOCKS[case] is None
    experts = {m.weight_format for m in blocks.model.modules() if isinstance(m, CppExperts)}
    if name.startswith("v") or name == "mixtral":  # routed experts: [i, 64] gate/up as blocks, [64, 40] down
        # decoded (40 columns); Mixtral's file names them block_sparse_moe.experts.N.w1/w3/w2
        assert experts == ({f"f32/{BLOCKS[case].lower()}"} if BLOCKS[case] else {"f32"}), experts
    got = prefill_logits(blocks, ids)
    if name.startswith("llama"):
        assert rel_err(got, ref) <= 3e-2
    else:  # 8-bit activations flip a few routing choices in the tiny MoE models (bf16 ones do too)
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("case", ["ct4_sym", "ct8_channel"])
def test_transformers_reads_compressed_tensors_files_as_we_do(tmp_path, case):
    """transformers itself (through compressed-tensors) loads the llm-compressor W4A16 / W8A16 directory: same
    logits. (It reads no asymmetric packed file of this compressed-tensors version: it allocates the zero points
    unpacked; int8 W8A8 files it runs with int8 activations, which mlaserve does not: llama.cpp's converter
    checks those weights above.)"""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    build_hf_model("llama_gqa_tied", seed=45).save_pretrained(tmp_path)
    WRITERS[case](tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt(40, hf.config.vocab_size, seed=10)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(prefill_logits(make_runner(tmp_path), ids), ref) <= 1e-4


# ----------------------------------------------------------------------------- hostile files

LAYER = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gptq")
    build_hf_model("llama_gqa_tied", seed=46).save_pretrained(d)
    write_gptq(d, 4, 32, symmetric=True)
    return d


@pytest.mark.parametrize("edit, says", [
    (lambda sd: sd.pop(f"{LAYER}.qzeros"), [f"'{LAYER}.scales' has no '{LAYER}.qzeros' beside it"]),
    (lambda sd: sd.__setitem__(f"{LAYER}.scales", sd[f"{LAYER}.scales"][:, :-1].contiguous()),
     [f"'{LAYER}.scales'", "must be BF16 or F16 or F32 [4, 64], not F16 [4, 63]"]),
    (lambda sd: sd.__setitem__(f"{LAYER}.qweight", sd[f"{LAYER}.qweight"].long()), ["must be I32 [16, 64], not I64"]),
    (lambda sd: sd.__setitem__(f"{LAYER}.qzeros", sd[f"{LAYER}.qzeros"][:1].contiguous()), ["must be I32 [4, 8]"]),
    (lambda sd: sd[f"{LAYER}.g_idx"].__setitem__(5, 9), [f"'{LAYER}.g_idx' names groups outside 0..3"]),
    (lambda sd: sd[f"{LAYER}.scales"].__setitem__((0, 3), float("nan")), ["1 scale(s) that are not finite"]),
    (lambda sd: sd.__setitem__(f"{LAYER}.weight", torch.randn(64, 128)), [f"'{LAYER}.weight' is stored both"]),
])
def test_damaged_files_are_refused_by_name(gptq_dir, tmp_path, edit, says):
    _fails(_broken(gptq_dir, tmp_path, edit), *says)


@pytest.mark.parametrize("config, says", [
    ({"bits": 3}, "3-bit weights are not supported (only 4 and 8-bit)"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"dynamic": {"+:.*down_proj": {"bits": 8}}}, "per-module overrides ('dynamic') other than modules left"),
    ({"is_marlin_format": True}, "is_marlin_format is not supported"),
    ({"bits": None}, "bits is missing"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 8}, "8-bit weights are not supported (only 4-bit)"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported (read: fp8, gptq, awq, "
                                       "compressed-tensors)"),
])
def test_schemes_not_read_are_refused_before_the_weights(gptq_dir, tmp_path, config, says):
    d = _broken(gptq_dir, tmp_path, quant=config)
    if config.get("bits", 4) is None:  # (absent, not null)
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]["bits"]
        (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, says)


def _ct_dir(tmp_path: Path, seed: int) -> tuple[Path, dict, dict, dict]:
    """A compressed-tensors W4A16 directory, and its config, quantization_config and config group to edit."""
    d = tmp_path / "ct"
    build_hf_model("llama_gqa_tied", seed=seed).save_pretrained(d)
    write_compressed_tensors(d, 4, 32)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    return d, cfg, qc, qc["config_groups"]["group_0"]


def test_compressed_tensors_schemes_not_read_are_refused(tmp_path):
    d, cfg, qc, group = _ct_dir(tmp_path, 47)
    for change, says in [
        ({"config_groups": {"a": group, "b": {**group, "weights": {**group["weights"], "num_bits": 8}}}},
         "config groups with different schemes are not supported"),
        ({"config_groups": {"a": {**group, "format": "marlin-24"}}}, "format 'marlin-24' is not supported"),
        ({"config_groups": {"a": {**group, "weights": {**group["weights"], "strategy": "tensor"}}}},
         "weight strategy 'tensor' is not supported"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config is not supported"),
    ]:
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**qc, **change}}))
        _fails(d, says)
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    sd[f"{LAYER}.weight_shape"] = torch.tensor([64, 100])
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    _fails(d, f"'{LAYER}.weight_shape' (the shape of '{LAYER}.weight') must be [64, in] with in packed as 16 words")


# ----------------------------------------------------------------------------- other readers of the weights


def test_tensor_parallel_parts_and_gguf_conversion(tmp_path):
    """A rank's part of a quantized weight (rows, columns, several ranges) is that part of the whole; and
    `write_gguf` converts the quantized directory (dequantized) to an F32 GGUF with the directory's logits."""
    d = write_checkpoint(tmp_path / "awq", "tiny-llama", seed=48)
    want = write_awq(d, 32)
    ckpt = HFCheckpoint(d)
    for name, w in want.items():
        rows, cols = w.shape
        for shard in (Shard(0, ((3, rows - 5),)), Shard(1, ((7, cols - 1),)), Shard(0, ((1, 9), (17, rows)))):
            part = ckpt.get_shard(name, shard)
            assert torch.equal(part, torch.cat([w[a:b] if shard.dim == 0 else w[:, a:b] for a, b in shard.ranges],
                                               dim=shard.dim)), (name, shard)
    gguf = write_gguf(d, tmp_path / "model.gguf", "F32")
    ids = prompt(30, 1000, seed=11)
    assert rel_err(prefill_logits(make_runner(gguf), ids), prefill_logits(make_runner(d), ids)) <= 1e-5


def test_gptq_deepseek_is_served(tmp_path):
    """`mlaserve serve` on a GPTQ DeepSeek-V3-shaped directory (its defaults: the native CPU forward, weights as
    the file's blocks, routed experts in the C++ pool): greedy tokens equal the same model loaded here."""
    d = write_checkpoint(tmp_path / "v3", "tiny-deepseek-v3", seed=49)
    write_gptq(d, 4, 32, symmetric=True)
    loaded = load_model(d, dtype="float32", progress=False)
    ids = loaded.tokenizer.encode("The lighthouse keeper")
    want = make_runner(d, cpu_weights="file").generate_greedy(ids, 8)
    reply = served_greedy(d, tmp_path, ids, 8, "--kv-dtype", "float32")
    assert reply["choices"][0]["text"] == loaded.tokenizer.decode(want)


@pytest.mark.parametrize("case", list(WRITERS))
def test_weights_read_a_part_at_a_time_are_the_same(tmp_path, monkeypatch, case):
    """A weight is unpacked a few output rows at a time (a large LM head whole would take gigabytes while
    converted): with parts of 32 rows, every weight, dequantized or as blocks, is what it is read whole."""
    import models.loader.safetensors_loader as loader

    build_hf_model("llama_gqa_tied", seed=51).save_pretrained(tmp_path)
    want = WRITERS[case](tmp_path)
    whole = HFCheckpoint(tmp_path)
    monkeypatch.setattr(loader, "INT_CHUNK_VALUES", 32 * 64)
    parts = HFCheckpoint(tmp_path)
    assert len(parts._int_row_chunks("model.layers.0.mlp.gate_proj.weight")) == 4  # 128 rows
    for name, w in want.items():
        assert torch.equal(parts.get(name), w), name
        a, b = whole.get_raw(name), parts.get_raw(name)
        assert type(a) is type(b), name
        if isinstance(a, RawBlocks):
            assert a.qtype == b.qtype and np.array_equal(a.data, b.data), name
        else:
            assert torch.equal(a, b), name


def test_a_weight_needs_the_widest_block_type_of_its_parts(tmp_path, monkeypatch):
    """Parts of one weight whose values need different block types (rows in [-8, 7], rows wider) take the
    type that holds them all; a dequantized fallback says why in the log, once."""
    import models.loader.safetensors_loader as loader

    build_hf_model("llama_gqa_tied", seed=52).save_pretrained(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    sd = load_file(tmp_path / "model.safetensors")
    gen = torch.Generator().manual_seed(8)
    steps = torch.randint(-8, 8, (128, 64), generator=gen)
    steps[:64, ::32], steps[:64, 1::32] = -8, 7  # rows 0-63: every group from -8 to 7 steps, zero point 8
    steps[64:] += 8
    steps[64:, ::32], steps[64:, 1::32] = 0, 15  # rows 64-127: from 0 to 15 steps, zero point 0
    sd[name] = steps.float() * 0.01
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    want = write_gptq(tmp_path, 4, 32, symmetric=False, v2=True)
    monkeypatch.setattr(loader, "INT_CHUNK_VALUES", 64 * 64)
    ckpt = HFCheckpoint(tmp_path)
    assert [ckpt._int_weight(name, rows).block_type()[0].name for rows in ckpt._int_row_chunks(name)] == [
        "Q4_0", "Q5_0"]
    raw = ckpt.get_raw(name)
    assert isinstance(raw, RawBlocks) and raw.qtype.name == "Q5_0" and torch.equal(raw.dequantize(), want[name])


def test_dequantized_fallbacks_are_logged_once_per_reason(tmp_path, caplog):
    build_hf_model("llama_gqa_tied", seed=53).save_pretrained(tmp_path)
    write_gptq(tmp_path, 4, 32, act_order=True, seed=1)
    ckpt = HFCheckpoint(tmp_path)
    with caplog.at_level("INFO", logger="models.loader.safetensors_loader"):
        for name in list(ckpt.layout()):
            ckpt.get_raw(name)
    said = [r.getMessage() for r in caplog.records if "held dequantized" in r.getMessage()]
    assert len(said) == 1 and "act-order groups are not runs of columns" in said[0], said


def test_older_gptq_files_load(gptq_dir, tmp_path):
    """What GPTQ-for-LLaMa and early AutoGPTQ wrote: a zero bias beside every quantized layer, the rotary
    tables, and the settings in quantize_config.json alone; compressed-tensors' older `compression_config`
    key. The same model loads (vLLM reads them so); a bias that is not zero is still refused."""
    ids = prompt(30, 320, seed=13)
    want = prefill_logits(make_runner(gptq_dir), ids)

    def older(sd):
        for n in [n for n in sd if n.endswith(".qweight")]:
            sd[n[: -len(".qweight")] + ".bias"] = torch.zeros(sd[n].shape[1], dtype=torch.float16)
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)

    d = _broken(gptq_dir, tmp_path, older)
    cfg = json.loads((d / "config.json").read_text())
    (d / "quantize_config.json").write_text(json.dumps({k: v for k, v in cfg.pop("quantization_config").items()
                                                        if k != "quant_method"}))
    (d / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(prefill_logits(make_runner(d), ids), want)
    sd = load_file(d / "model.safetensors")
    sd[f"{LAYER}.bias"] = torch.full_like(sd[f"{LAYER}.bias"], 0.5)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    _fails(d, f"unexpected tensor '{LAYER}.bias'")


def test_compression_config_is_read(tmp_path):
    d = tmp_path / "ct"
    build_hf_model("llama_gqa_tied", seed=54).save_pretrained(d)
    want = write_compressed_tensors(d, 4, 32)
    cfg = json.loads((d / "config.json").read_text())
    cfg["compression_config"] = cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    name = next(iter(want))
    assert torch.equal(HFCheckpoint(d).get(name), want[name])


def test_act_order_without_its_group_index_is_refused(tmp_path):
    build_hf_model("llama_gqa_tied", seed=55).save_pretrained(tmp_path)
    write_gptq(tmp_path, 4, 32, act_order=True)
    sd = load_file(tmp_path / "model.safetensors")
    del sd[f"{LAYER}.g_idx"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _fails(tmp_path, f"'{LAYER}.scales' has no '{LAYER}.g_idx' beside it")


def test_compressed_tensors_int8_per_tensor_scale(tmp_path):
    """W8A8 int8 with one scale a tensor (strategy `tensor`): Q8_0 blocks of that one scale."""
    build_hf_model("llama_gqa_tied", seed=56).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for name in [n for n in sd if n.endswith("_proj.weight")]:
        w = sd[name].float()
        scale = (w.abs().max() / 127).to(torch.bfloat16)
        sd[name] = (w / scale.float()).round().clamp(-128, 127).to(torch.int8)
        sd[name + "_scale"] = scale.reshape(1)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                  "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = HFCheckpoint(tmp_path)
    name = f"{LAYER}.weight"
    want = sd[name].float() * sd[name + "_scale"].float()
    raw = ckpt.get_raw(name)
    assert torch.equal(ckpt.get(name), want) and raw.qtype.name == "Q8_0" and torch.equal(raw.dequantize(), want)


@pytest.mark.parametrize("change, says", [
    ({"sparsity_config": "dense"}, "sparsity_config is not supported"),
    ({"format": ["pack-quantized"]}, "has no format (a string)"),
    ({"weights": {"symmetric": "false"}}, "symmetric must be true or false"),
])
def test_compressed_tensors_configs_of_the_wrong_types(tmp_path, change, says):
    d, cfg, qc, group = _ct_dir(tmp_path, 57)
    if "weights" in change:
        group["weights"] |= change["weights"]
    elif "format" in change:
        group["format"] = qc["format"] = change["format"]
    else:
        qc |= change
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, says)
    assert main(["serve", "--model", str(d), "--port", "1"]) == 2  # refused before it binds, not a traceback
