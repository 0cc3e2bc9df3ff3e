"""The `mlaserve` command line itself: its usage and unknown commands, and a --model that is no model,
refused by `generate`, `serve` and `calibrate-omnikv` alike in one line (exit 2), before anything loads
or binds (`server.args.model_problem`, `mlaserve.model_check.load_model_checked`)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlaserve.cli import COMMANDS, main
from models.synthetic import write_checkpoint
from server.args import model_problem
from tests.server.server_process import REPO, free_port


@pytest.fixture(autouse=True)
def _no_mlaserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("MLASERVE_")]:
        monkeypatch.delenv(var)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny-llama", seed=5, num_layers=2)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_goes_to_stdout(flag: str, capsys: pytest.CaptureFixture) -> None:
    assert main([flag]) == 0
    out, err = capsys.readouterr()
    assert err == "" and all(name in out for name in COMMANDS)


def test_no_command_prints_the_usage_and_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and all(name in err for name in COMMANDS)


@pytest.mark.parametrize(("argv", "says"), [
    (["bogus"], "mlaserve: error: unknown command 'bogus'; the commands: serve, generate"),
    (["serv", "--port", "8000"], "unknown command 'serv' (did you mean 'serve'?)"),
    (["--port", "8000"], "'--port' is not a command: the command comes first (e.g. mlaserve serve --port ...)"),
])
def test_an_unknown_command_is_named_in_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and says in one_line(err) and "mlaserve --help" in err


def test_the_console_script_says_it_too() -> None:
    """Through the interpreter, as a user runs it: one line on stderr, exit 2; --help on stdout, exit 0."""
    bogus = subprocess.run([sys.executable, "-m", "mlaserve.cli", "bogus"], cwd=REPO, capture_output=True, text=True)
    assert bogus.returncode == 2 and bogus.stdout == ""
    assert one_line(bogus.stderr).startswith("mlaserve: error: unknown command 'bogus'")
    helped = subprocess.run([sys.executable, "-m", "mlaserve.cli", "--help"], cwd=REPO, capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stderr == "" and "calibrate-omnikv" in helped.stdout


def test_version_is_a_flag_of_its_own(capsys: pytest.CaptureFixture) -> None:
    """`mlaserve --version` prints the installed version (it used to suggest `mlaserve serve --version`,
    which argparse then refused)."""
    from server.app import mlaserve_version

    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        out, err = capsys.readouterr()
        assert out == f"mlaserve {mlaserve_version()}\n" and err == ""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_a_reader_that_leaves_early_gets_no_traceback(argv: list[str]) -> None:
    """`mlaserve --help | head -1`: stdout's reader is gone before the usage is written (a pipe whose read
    end is closed); the command ends quietly instead of printing a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "mlaserve", *argv], cwd=REPO, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), done.stderr


def test_generate_refuses_an_empty_prompt_in_one_line(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    """A prompt that encodes to no tokens (the tiny model, like SmolLM2's GGUF, adds no BOS token): one
    line, exit 2 (it was a ValueError traceback from the runner)."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--prompt", "", "--max-tokens", "2"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and line == ("mlaserve generate: error: --prompt encodes to no tokens: give some text "
                                             "to continue (or --chat)"), line


@pytest.mark.parametrize("case", ["layers 0", "layers -2", "out is a file", "out under a file", "no preset", "out empty"])
def test_make_checkpoint_refuses_bad_input_in_one_line(case: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Bad --layers, a missing flag or an --out that cannot be a directory: one error line, exit 2, as
    the other commands (they were a CheckpointError / FileExistsError traceback, then argparse's whole
    usage before the line)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out = {"out is a file": a_file, "out under a file": a_file / "sub", "out empty": ""}.get(case, tmp_path / "ckpt")
    argv = ["make-checkpoint", "--preset", "tiny-llama", "--out", str(out)]
    if case.startswith("layers"):
        argv += ["--layers", case.split()[1]]
    if case == "no preset":
        argv = argv[:1] + argv[3:]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    line = one_line(err)
    expect = {"layers 0": "argument --layers: 0 must be > 0", "layers -2": "argument --layers: -2 must be > 0",
              "out is a file": f"cannot write --out {a_file}: it is a file, not a directory",
              "out under a file": f"cannot write --out {a_file / 'sub'}: Not a directory",
              "no preset": "the following arguments are required: --preset",
              "out empty": "argument --out: must name a directory"}[case]
    assert line.startswith("mlaserve make-checkpoint: error: ") and expect in line, line
    assert a_file.read_text() == "x"


def test_make_checkpoint_refuses_a_directory_that_holds_files_unless_forced(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """A real model's directory given as --out by mistake kept nothing: its shards were deleted and its
    config and tokenizer replaced. Now a directory holding files is refused, one line, untouched; --force
    writes into it."""
    model = tmp_path / "realmodel"
    model.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (model / name).write_text(name)
    with pytest.raises(SystemExit) as info:
        main(["make-checkpoint", "--preset", "tiny-llama", "--out", str(model)])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and "is not empty (it holds 3 file(s): config.json, model-00001" in line, line
    assert all((model / n).read_text() == n for n in ("config.json", "model.safetensors.index.json"))
    assert main(["make-checkpoint", "--preset", "tiny-llama", "--out", str(model), "--force"]) == 0
    assert not (model / "model-00001-of-00002.safetensors").exists() and (model / "model.safetensors").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["make-checkpoint", "--preset", "tiny-llama", "--out", str(empty)]) == 0  # an empty one is fine


# --- a --model that is no model


def _gguf_dir(root: Path, names: tuple[str, ...] = ("model.gguf",)) -> Path:
    d = root / "gguf_only"
    d.mkdir()
    for name in names:
        (d / name).write_bytes(b"GGUF" + bytes(60))
    return d


def test_model_problem_says_what_the_path_is(checkpoint: Path, tmp_path: Path) -> None:
    assert model_problem(str(checkpoint)) is None
    assert "neither a built-in name" in model_problem(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    said = model_problem(str(empty))
    assert said.startswith(f"{empty} is a directory without config.json, so not an HF model directory")
    assert "GGUF file in it" not in said
    gguf_dir = _gguf_dir(tmp_path)
    assert model_problem(str(gguf_dir)).endswith(f"to use the GGUF file in it, pass --model {gguf_dir / 'model.gguf'}")
    # the file itself: its header is read (here, all zeros after the magic: version 0)
    assert "unsupported GGUF version 0" in model_problem(str(gguf_dir / "model.gguf"))
    (gguf_dir / "b.GGUF").write_bytes(b"GGUF")
    assert f"one of its 2 GGUF files, pass it as --model (e.g. --model {gguf_dir / 'b.GGUF'})" in model_problem(
        str(gguf_dir))
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((checkpoint / "config.json").read_text())
    assert model_problem(str(no_tok)) == (f"the HF model directory {no_tok} has no tokenizer.json: copy the model's "
                                          "tokenizer.json beside its config.json")
    (no_tok / "tiktoken.model").write_text("")  # Kimi-K2's tokenizer instead (checked as it loads): the weights next
    assert model_problem(str(no_tok)).endswith("no *.safetensors weight files")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert model_problem(str(text)).startswith(f"{text} is not a GGUF file")


def _corrupt(checkpoint: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for f in checkpoint.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text("{ not json")
    return bad


def _bad_model(case: str, checkpoint: Path, tmp_path: Path) -> tuple[Path, str]:
    """(a --model of this kind, what the refusal says)"""
    if case == "missing":
        return tmp_path / "nope", "is neither a built-in name"
    if case == "empty_dir":
        (tmp_path / "e").mkdir()
        return tmp_path / "e", "is a directory without config.json"
    if case == "gguf_dir":
        return _gguf_dir(tmp_path), "pass --model"
    if case == "not_gguf":
        (tmp_path / "x.txt").write_text("hi")
        return tmp_path / "x.txt", "is not a GGUF file"
    return _corrupt(checkpoint, tmp_path), "config.json: not valid JSON"


@pytest.mark.parametrize("case", ["missing", "empty_dir", "gguf_dir", "not_gguf", "corrupt"])
def test_generate_refuses_a_bad_model_in_one_line(case: str, checkpoint: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    model, says = _bad_model(case, checkpoint, tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model), "--prompt", "hi"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    line = one_line(err)
    assert out == "" and line.startswith("mlaserve generate: error: ") and says in line, line
    if case == "corrupt":  # the loader's message, the file said once
        assert line == (f"mlaserve generate: error: cannot load the model {model}: {model}/config.json: not valid "
                        "JSON: Expecting property name enclosed in double quotes: line 1 column 3 (char 2)"), line


@pytest.mark.parametrize(("argv", "stdin", "env", "says"), [
    (["--prompt", "caf\udce9"], None, {}, "--prompt is not UTF-8 text (byte 3: b'\\xe9'): convert it to UTF-8"),
    (["--prompt", "-"], io.BytesIO(b"\xff\xfeabc"), {}, "--prompt - (standard input) is not UTF-8 text (byte 0: "),
    (["--prompt", "-"], "closed", {}, "--prompt -: there is no standard input to read (it is closed)"),
    (["--prompt", "x", "--expert-backend", "triton"], None, {}, "--expert-backend triton needs --device cuda"),
    (["--prompt", "x", "--cpu-weight-dtype", "float32", "--dtype", "bfloat16"], None, {},
     "--cpu-weight-dtype float32 holds every weight in fp32"),
    (["--prompt", "x"], None, {"MLASERVE_CPP_EXPERTS_THREADS": "abc"}, "MLASERVE_CPP_EXPERTS_THREADS='abc' must be"),
])
def test_generate_refuses_what_serve_refuses_before_loading(argv: list[str], stdin: object, env: dict[str, str],
                                                            says: str, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that is not UTF-8 (a stray byte in argv or stdin), a closed stdin, and the settings `serve`
    refuses together: one line, exit 2, before the model loads. They were tracebacks after the load, or
    ran."""
    if stdin == "closed":
        monkeypatch.setattr("sys.stdin", None)
    elif stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the tests' own: Triton on a CPU)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", "smollm2-135m-instruct", *argv])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and one_line(err).startswith("mlaserve generate: error: ")
    assert says in one_line(err), err


def test_generate_still_generates(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(checkpoint), "--prompt", "hello", "--max-tokens", "2"]) == 0
    assert "generated in" in capsys.readouterr().err


def test_generate_writes_what_the_engine_serves(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate` loads and runs the model as `serve` does (on a CPU the native kernels, the GGUF's blocks
    as stored): its text is the engine's greedy text. It was the torch reference's over dequantized weights,
    another text for the default model (8-bit activations move near-ties) and ~30x slower. `--prompt -`
    reads the prompt from stdin."""

    from engine.args import EngineArgs
    from engine.core import EngineCore
    from engine.messages import GenerateRequest
    from models.loader.tokenizer import load_tokenizer
    from scheduler.sampling_params import SamplingParams

    prompt, n = "Once upon a time", 40
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    assert main(["generate", "--model", "smollm2-135m-instruct", "--prompt", "-", "--max-tokens", str(n)]) == 0
    got = capsys.readouterr().out
    tok = load_tokenizer("smollm2-135m-instruct")
    core = EngineCore(EngineArgs(model="smollm2-135m-instruct", max_total_tokens=256, max_running_requests=1))
    try:
        core.add_request(GenerateRequest("g", tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=n)))
        ids = []
        while core.has_work():
            ids += [t for o in core.step() for t in o.new_token_ids]
    finally:
        core.close()
    assert got == tok.decode(ids) + "\n"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_keeps_the_kv_cache_serve_keeps(dtype: str, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-dtype auto` is the engine's: bf16 for GGUF blocks on the native forward whatever --dtype. generate
    kept the model's dtype, fp32 where the CPU has no bf16 math (auto) or with --dtype float32: another forward
    than serve's, whose greedy text differed at a near-tie (SmolLM2-135M, AVX2: the 33rd token, 0.02 apart)."""
    import torch

    from engine.args import EngineArgs
    from engine.core import EngineCore
    from executor.model_runner import ModelRunner

    kept = []
    init = ModelRunner.__init__

    def recording(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        kept.append(self.kv_pool.dtype)

    monkeypatch.setattr(ModelRunner, "__init__", recording)
    assert main(["generate", "--model", "smollm2-135m-instruct", "--dtype", dtype, "--prompt", "hi",
                 "--max-tokens", "1"]) == 0
    core = EngineCore(EngineArgs(model="smollm2-135m-instruct", dtype=dtype, max_total_tokens=64,
                                 max_running_requests=1))
    core.close()
    assert kept == [torch.bfloat16, torch.bfloat16]
    assert main(["generate", "--model", "smollm2-135m-instruct", "--dtype", dtype, "--kv-dtype", "float32",
                 "--prompt", "hi", "--max-tokens", "1"]) == 0
    assert kept[2] == torch.float32


def test_generate_refuses_more_than_the_context_in_one_line(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    """Prompt + --max-tokens past the model's context: one line naming the bound (it used to be an
    IndexError from the rotary table, after the prompt had run)."""
    import json

    context = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--prompt", "hello", "--max-tokens", str(context)])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and f"exceed the model's context of {context} tokens" in line, line
    assert "lower --max-tokens to at most" in line, line


def test_generate_chat_with_a_failing_template_is_one_line(checkpoint: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "m"
    model.mkdir()
    for f in checkpoint.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "chat_template.jinja").write_text("{{ raise_exception('this template takes no user turns') }}")
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model), "--prompt", "hi", "--chat", "--max-tokens", "2"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and line.startswith("mlaserve generate: error: --chat: "), line
    assert "this template takes no user turns" in line, line


@pytest.mark.parametrize("case", ["past_vocab", "panics"])
def test_generate_refuses_a_prompt_the_model_cannot_take_in_one_line(case: str, checkpoint: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """An added token with no embedding row (serve answers 400) and a tokenizer.json regex that panics on the
    text (a BaseException from Rust) were tracebacks."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(checkpoint, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    if case == "past_vocab":
        spec["added_tokens"].append({"id": vocab, "content": "<tool>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
        prompt, want = "hi <tool>", f"the prompt holds tokens '<tool>' ({vocab}) past the model's vocab_size {vocab}"
    else:
        spec["pre_tokenizer"]["pretokenizers"].insert(
            0, {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False})
        prompt, want = "a" * 40, "the model's tokenizer failed on this text: Onig: Regex search error"
    (model / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "2"])
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("mlaserve generate: error: ")]  # (Rust's panic report
    assert info.value.code == 2 and len(line) == 1 and want in line[0], err              # goes to stderr too)
    assert "Traceback" not in err


@pytest.mark.parametrize("error", [MemoryError("std::bad_alloc"), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "738197504 bytes. Error code 12 (Cannot allocate memory)")], ids=["bad_alloc", "torch"])
def test_a_model_the_memory_cannot_hold_is_one_line(error: BaseException, checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """An allocation that fails while the weights load (the native loader's bad_alloc, torch's allocator) was a
    traceback of 35-44 lines; it is one line saying what to do. Another RuntimeError stays a bug's traceback."""
    from mlaserve import model_check

    def load(*a, **kw):
        raise error

    monkeypatch.setattr(model_check, "load_model", load)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-tokens", "2"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2, line
    assert line.startswith("mlaserve generate: error: not enough memory to start the model ("), line
    assert "use a smaller quantization" in line
    monkeypatch.setattr(model_check, "load_model", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-tokens", "2"])


@pytest.mark.parametrize("argv,says", [
    (["generate", "--model", "~no-such-user-mlaserve/m.gguf", "--prompt", "hi"],
     "model '~no-such-user-mlaserve/m.gguf' is neither a built-in name"),
    (["serve", "--model", "~no-such-user-mlaserve/m.gguf"], "model '~no-such-user-mlaserve/m.gguf' is neither"),
    (["serve", "--chat-template", "~no-such-user-mlaserve/t.jinja"], "'~no-such-user-mlaserve/t.jinja' names no file"),
    (["calibrate-omnikv", "--model", "~no-such-user-mlaserve/m.gguf", "--text", __file__],
     "model '~no-such-user-mlaserve/m.gguf' is neither"),
])
def test_a_home_of_no_user_is_a_path_that_does_not_exist(argv: list[str], says: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    """`~name/...` of no user on this machine (a shell leaves it as written): Path.expanduser's RuntimeError
    was a traceback of 27-55 lines; it is the path that names nothing, in one line."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    line = one_line(capsys.readouterr().err)
    assert code == 2 and says in line, line


def test_a_tokenizer_that_cannot_encode_text_is_warned_of_and_fails_per_prompt(checkpoint: Path, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A tokenizer.json that loads but cannot encode plain text (a WordLevel model whose unknown token is not in
    its vocabulary): `generate` was a traceback. It is warned of at load and the prompt it cannot encode is one
    line; one it can encode runs (a closed vocabulary is a tokenizer that works on its own texts)."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(checkpoint, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    # the words of letters alone: "Hello" is one, " world" (a space in it) is not
    vocab = {k: v for k, v in spec["model"]["vocab"].items() if k.isascii() and k.isalpha()}
    spec["model"] = {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    with caplog.at_level("WARNING"), pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model), "--prompt", "Hello world", "--max-tokens", "2"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and "the model's tokenizer failed on this text: WordLevel error: Missing [UNK]" in line
    assert "the tokenizer cannot encode 'Hello, world! 123" in caplog.text
    assert main(["generate", "--model", str(model), "--prompt", "Hello", "--max-tokens", "2"]) == 0


@pytest.mark.parametrize("case", ["empty_dir", "gguf_dir"])
def test_serve_refuses_a_directory_that_is_no_model_before_it_binds(case: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    model = _gguf_dir(tmp_path) if case == "gguf_dir" else tmp_path
    assert main(["serve", "--model", str(model), "--port", str(free_port())]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"mlaserve serve: error: {model} is a directory without config.json"), line
    assert "tokenizer.json" not in line
    if case == "gguf_dir":
        assert line.endswith(f"pass --model {model / 'model.gguf'}"), line


@pytest.mark.parametrize("case", ["corrupt", "gelu", "awq"])
def test_serve_refuses_a_config_the_loader_refuses_before_it_binds(case: str, checkpoint: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """A config.json that is not JSON or asks for what is not served (an MLP activation other than SiLU, a
    quantization method not read): one line and exit 2 before the server binds, as `generate` says it (the
    engine failed after the bind, exit 1, which a supervisor takes for "restart me")."""
    import json

    if case == "corrupt":
        model, says = _corrupt(checkpoint, tmp_path), "config.json: not valid JSON"
    else:
        model = tmp_path / case
        model.mkdir()
        for f in checkpoint.iterdir():
            (model / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((model / "config.json").read_text())
        change = {"hidden_act": "gelu"} if case == "gelu" else {"quantization_config": {"quant_method": "bitsandbytes"}}
        (model / "config.json").write_text(json.dumps(dict(cfg, **change)))
        says = ("config key 'hidden_act' is 'gelu': only SiLU-gated MLPs are supported" if case == "gelu"
                else "quant_method 'bitsandbytes' is not supported")
    assert main(["serve", "--model", str(model), "--port", str(free_port())]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"mlaserve serve: error: cannot load the model {model}: {model}/config.json: "), line
    assert says in line, line


@pytest.mark.parametrize("case", ["no_weights", "truncated_gguf"])
def test_serve_refuses_model_files_the_loader_refuses_before_it_binds(case: str, checkpoint: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A directory without weight files (a pickle checkpoint named) and a GGUF cut short: one line and exit 2
    before the server binds (they failed after the bind, exit 1). The second file of a split model is refused
    the same way (tests/models/test_gguf_files.py)."""
    from models.builtin import DEFAULT_MODEL, builtin_model_path

    if case == "no_weights":
        model = tmp_path / "ck"
        model.mkdir()
        for f in checkpoint.iterdir():
            if f.suffix != ".safetensors":
                (model / f.name).write_bytes(f.read_bytes())
        (model / "pytorch_model.bin").write_bytes(b"x")
        says = f"cannot load the model {model}: no *.safetensors weight files (found pytorch_model.bin"
    else:
        model = tmp_path / "cut.gguf"
        model.write_bytes(builtin_model_path(DEFAULT_MODEL).read_bytes()[:100_000])
        says = f"cannot load the model {model}: file is truncated"
    assert main(["serve", "--model", str(model), "--port", str(free_port())]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"mlaserve serve: error: {says}"), line


def test_calibrate_refuses_a_gguf_directory_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = tmp_path / "text.txt"
    text.write_text("word " * 100)
    model = _gguf_dir(tmp_path)
    assert main(["calibrate-omnikv", "--model", str(model), "--text", str(text), "--output",
                 str(tmp_path / "o.json")]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"mlaserve calibrate-omnikv: error: {model} is a directory without config.json"), line
    assert not (tmp_path / "o.json").exists()


def test_a_bad_variable_that_a_flag_overrides_does_not_stop_generate(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MLASERVE_DTYPE", "fp8")
    assert main(["generate", "--model", str(checkpoint), "--dtype", "float32", "--prompt", "hi",
                 "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert ("mlaserve generate: warning: MLASERVE_DTYPE is ignored, as --dtype on the command line wins; its value "
            "would be refused: invalid choice 'fp8'") in err


def test_generate_refuses_a_cuda_device_the_machine_lacks(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--device", "cuda", "--prompt", "hi"])
    assert info.value.code == 2 and one_line(capsys.readouterr().err) == (
        "mlaserve generate: error: --device cuda: this machine (or this torch build) has no CUDA device; use "
        "--device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--device", "cuda:2", "--prompt", "hi"])
    assert info.value.code == 2 and one_line(capsys.readouterr().err) == (
        "mlaserve generate: error: --device cuda:2: this machine has 2 CUDA device(s), 0..1")


def test_a_node_rank_checks_the_model_too(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Another machine of a multi-node --tp runs no HTTP server, but its --model is checked the same way."""
    model = _gguf_dir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model), "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port",
              "29500"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and line.endswith(f"pass --model {model / 'model.gguf'}"), line


def test_our_top_level_packages_are_the_ones_imported_anywhere(tmp_path: Path) -> None:
    """Run from outside the repository (as the installed `mlaserve` command is), each of the project's
    top-level packages imports from the project, whole: no installed distribution brings a package of the
    same name. transformers 5.25 brought Hugging Face's `kernels` (whose __init__ was then found instead of
    ours, and which made transformers import ours as its own); pyproject.toml keeps transformers below it."""
    import subprocess
    import sys

    from tests.server.server_process import REPO

    names = ["mlaserve", "server", "engine", "scheduler", "executor", "models", "kernels", "cpp_experts", "configs"]
    code = ("import importlib, json, sys; print(json.dumps({n: getattr(importlib.import_module(n), '__file__', None) "
            f"for n in {names!r}}}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    where = json.loads(r.stdout.strip().splitlines()[-1])
    for name in names:
        assert where[name] == str(REPO / name / "__init__.py"), (name, where[name])


def test_python_m_mlaserve_ignores_same_named_modules_where_it_is_run(tmp_path: Path) -> None:
    """`python -m mlaserve` run where the user keeps a `server.py`, a `models/` package and others of our
    packages' plain names (common in a project folder): the command works as the installed one does. `-m`
    put the current directory first on sys.path, and `import server` found the user's file."""
    import subprocess
    import sys

    (tmp_path / "server.py").write_text("raise SystemExit('the user server.py was imported')\n")
    for name in ("models", "engine", "kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('the user {name}/ was imported')\n")
    r = subprocess.run([sys.executable, "-m", "mlaserve", "generate", "--model", "smollm2-135m-instruct",
                        "--prompt", "The capital of France is", "--max-tokens", "3"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 generated" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize(("command", "code"), [("serve", 0), ("generate", 130)])
def test_ctrl_c_before_a_command_handles_it_is_one_line(monkeypatch, capsys, command, code):
    """Ctrl-C in serve's first second (its imports, before its own signal handling) printed a 30-line
    KeyboardInterrupt traceback and died by the signal; serve exits 0 as for a signal while loading."""
    import mlaserve.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, command, interrupted)
    assert cli.main([command, "--model", "x"]) == code
    assert capsys.readouterr().err == f"mlaserve {command}: interrupted\n"


def test_serve_with_weights_the_engine_refuses_says_so_once(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint whose config passes the checks before the bind but whose weights the engine process refuses
    (a tensor missing): the loader's message once on stderr (the engine process, its client and the server each
    logged it: three times), and exit 2, as for a bad flag: the model is at fault, and a supervisor restarting
    the server on exit 1 would fail the same way forever."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "no_q_proj"
    model.mkdir()
    for f in checkpoint.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = {k: v for k, v in load_file(str(model / "model.safetensors")).items()
               if k != "model.layers.1.self_attn.q_proj.weight"}
    save_file(weights, str(model / "model.safetensors"))
    done = subprocess.run([sys.executable, "-m", "mlaserve.cli", "serve", "--model", str(model), "--port",
                           str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    says = "missing tensor(s): model.layers.1.self_attn.q_proj.weight"
    assert done.stderr.count(says) == 1, done.stderr
    assert "the engine failed to start" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_make_checkpoint_refuses_what_the_disk_cannot_hold(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset larger than the free space (deepseek-v3 is 12 GB in float32) is refused up front, naming both
    sizes, instead of failing half written; nothing is written."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**7, 0, 5 * 10**6))
    with pytest.raises(SystemExit) as info:
        main(["make-checkpoint", "--preset", "tiny-llama", "--out", str(tmp_path / "m"), "--gguf"])
    line = one_line(capsys.readouterr().err)
    assert info.value.code == 2 and "tiny-llama (3,219,776 parameters) needs about 25.8 MB" in line, line
    assert "has 5.0 MB free" in line and not (tmp_path / "m").exists()


def test_a_home_path_is_expanded_in_every_file_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--omnikv-config=~/c.json` (bash leaves `~` after `=` as written) and calibrate's `--text ~/t.txt` and
    `--output` read the home's file, as `--model` and `--chat-template` do; they said the file did not exist."""
    from mlaserve.calibrate_omnikv import read_text
    from models.omnikv_config import OmniKVConfig
    from server.args import parse_serve_args

    monkeypatch.setenv("HOME", str(tmp_path))
    OmniKVConfig(filter_layers=(1,)).save(tmp_path / "c.json")
    (tmp_path / "t.txt").write_text("some text")
    assert parse_serve_args(["--omnikv-config", "~/c.json"], environ={}).engine.omnikv_config == "~/c.json"
    assert OmniKVConfig.load("~/c.json").filter_layers == (1,)
    assert read_text("~/t.txt") == "some text"


def test_the_default_served_name(tmp_path: Path) -> None:
    """A link to a model directory serves the model's name (as it did before the name was shared with OmniKV's
    calibration label), a split GGUF its name without the part, a built-in model its name."""
    from server.launch import default_model_name

    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "llama-3-8b")
    assert default_model_name(str(tmp_path / "current")) == "llama-3-8b"
    assert default_model_name(str(tmp_path / "m-00001-of-00002.gguf")) == "m"
    assert default_model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
