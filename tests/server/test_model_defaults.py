"""The model's sampling defaults (`--generation-config`) and `--chat-template`, without a server: what the
files say, what is refused and named, and how a request's own fields are merged with the defaults.
The served behaviour is `test_model_defaults_e2e.py`'s."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import gguf
import pytest

from models.builtin import DEFAULT_MODEL
from models.loader.generation_config import raw_sampling_defaults
from models.loader.gguf_writer import write_gguf
from models.synthetic import write_checkpoint
from scheduler.sampling_params import SamplingParams
from server.chat_template import ChatTemplateError, load_chat_template, render_chat
from server.generation_defaults import (
    OPENAI_DEFAULTS,
    GenerationDefaults,
    checked_defaults,
    load_generation_defaults,
    with_defaults,
)
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, to_sampling_params

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
MODEL_DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny-llama", seed=3)


def with_generation_config(model_dir: Path, out: Path, **keys) -> Path:
    """A copy of `model_dir` (links to its files) whose generation_config.json also has `keys`."""
    out.mkdir()
    for f in model_dir.iterdir():
        (out / f.name).symlink_to(f)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (out / "generation_config.json").unlink()
    (out / "generation_config.json").write_text(json.dumps({**gen, **keys}))
    return out


# ---------------------------------------------------------------- the merge


def test_openai_defaults_are_the_engines() -> None:
    assert OPENAI_DEFAULTS == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def test_with_defaults_takes_what_was_sent_then_the_model_then_openai() -> None:
    assert with_defaults({}, {}) == OPENAI_DEFAULTS
    assert with_defaults({}, {"temperature": 0.2}) == {**OPENAI_DEFAULTS, "temperature": 0.2}
    assert with_defaults({"temperature": 1.0}, {"temperature": 0.2}) == OPENAI_DEFAULTS  # sent: kept
    assert with_defaults({"temperature": None}, {"temperature": 0.2})["temperature"] == 0.2  # null: the default
    assert with_defaults({"top_k": 5}, MODEL_DEFAULTS) == {**MODEL_DEFAULTS, "top_k": 5}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_absent_fields_take_the_models_defaults_present_ones_never(api: str) -> None:
    cls, base = (ChatCompletionRequest, CHAT) if api == "chat" else (CompletionRequest, COMPLETION)

    def params(**body) -> SamplingParams:
        return to_sampling_params(cls.model_validate({**base, **body}), MODEL_DEFAULTS)

    absent = params()
    assert {k: getattr(absent, k) for k in MODEL_DEFAULTS} == MODEL_DEFAULTS and absent.greedy
    # present with OpenAI's default value: still the request's, not the model's
    sent = params(temperature=1, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    assert {k: getattr(sent, k) for k in MODEL_DEFAULTS} == OPENAI_DEFAULTS and not sent.greedy
    assert params(top_k=0).top_k == -1  # the request's own "no limit"
    one = params(temperature=0.7)
    assert one.temperature == 0.7 and one.top_p == 0.8 and one.top_k == 40  # the rest from the model
    nulls = params(temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=None)
    assert {k: getattr(nulls, k) for k in MODEL_DEFAULTS} == MODEL_DEFAULTS  # null means "the default"
    # no defaults (--generation-config none): OpenAI's, as before
    plain = to_sampling_params(cls.model_validate(base))
    assert {k: getattr(plain, k) for k in MODEL_DEFAULTS} == OPENAI_DEFAULTS


def test_model_card_shows_the_defaults_in_force() -> None:
    card = ModelCard(id="m", created=1, generation_defaults=GenerationDefaults({"temperature": 0.2}).in_force())
    assert card.model_dump()["generation_defaults"] == {**OPENAI_DEFAULTS, "temperature": 0.2}
    assert "generation_defaults" not in ModelCard(id="m", created=1).model_dump()  # not known yet: left out


# ---------------------------------------------------------------- checking untrusted values


def test_good_values_pass_and_top_k_zero_means_all() -> None:
    good, problems = checked_defaults({"temperature": 0, "top_p": 0.95, "top_k": 0, "min_p": 0.1,
                                       "repetition_penalty": 1.05})
    assert problems == []
    assert good == {"temperature": 0.0, "top_p": 0.95, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.05}
    assert isinstance(good["temperature"], float)


@pytest.mark.parametrize("name,value", [
    ("temperature", "hot"), ("temperature", True), ("temperature", -1), ("temperature", math.nan),
    ("temperature", 10**400), ("top_p", 5), ("top_p", -0.1), ("top_p", [0.9]), ("top_k", 40.0), ("top_k", -3),
    ("top_k", "40"), ("min_p", 1.5), ("repetition_penalty", 0), ("repetition_penalty", math.inf),
    ("repetition_penalty", {"value": 1.1}),
])
def test_bad_values_are_named_and_left_out(name: str, value: object) -> None:
    good, problems = checked_defaults({name: value, "top_p": 0.5} if name != "top_p" else {name: value})
    assert name not in good
    assert len(problems) == 1 and problems[0].startswith(f"{name}="), problems


def test_an_hf_generation_config_with_bad_keys_loads_the_rest_and_warns(model_dir, tmp_path, caplog) -> None:
    d = with_generation_config(model_dir, tmp_path / "m", temperature="hot", top_p=5, top_k=20, min_p=None,
                               repetition_penalty=1.2, do_sample=False, max_new_tokens=7)
    with caplog.at_level(logging.WARNING, logger="mlaserve.server"):
        defaults = load_generation_defaults(str(d))
    assert dict(defaults.values) == {"top_k": 20, "repetition_penalty": 1.2}  # null min_p: not set
    assert defaults.source == str(d / "generation_config.json")
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "temperature='hot'" in warning and "top_p=5.0" in warning and "top_k" not in warning, warning
    assert "top_k=20" in defaults.describe() and "repetition_penalty=1.2" in defaults.describe()
    assert load_generation_defaults(str(d), "none") == GenerationDefaults(mode="none")  # --generation-config none


def test_without_sampling_keys_or_file_the_defaults_are_openais(model_dir, tmp_path, caplog) -> None:
    assert load_generation_defaults(str(model_dir)).values == {}  # the synthetic file has token ids only
    d = with_generation_config(model_dir, tmp_path / "gone")
    (d / "generation_config.json").unlink()
    assert load_generation_defaults(str(d)).in_force() == OPENAI_DEFAULTS
    not_an_object = with_generation_config(model_dir, tmp_path / "list")
    (not_an_object / "generation_config.json").write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="mlaserve.server"):
        assert load_generation_defaults(str(not_an_object)).values == {}  # warned, not raised
    assert "generation_config.json" in caplog.text


def test_gguf_sampling_keys_are_written_and_read_back(model_dir, tmp_path) -> None:
    d = with_generation_config(model_dir, tmp_path / "g", temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                               repetition_penalty=1.1)
    path = write_gguf(d, tmp_path / "g.gguf")
    # the gguf package (llama.cpp's reader) sees llama.cpp's keys with llama.cpp's types
    fields = gguf.GGUFReader(path).fields
    assert fields["general.sampling.top_k"].types == [gguf.GGUFValueType.INT32]
    assert fields["general.sampling.temp"].types == [gguf.GGUFValueType.FLOAT32]
    assert fields["general.sampling.penalty_repeat"].contents() == pytest.approx(1.1)
    raw, source = raw_sampling_defaults(path)
    assert raw == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert "general.sampling" in source  # (float32 values read back as the decimals written)
    assert load_generation_defaults(str(path)).values == raw
    # none in generation_config.json: no key written
    plain = write_gguf(model_dir, tmp_path / "plain.gguf")
    assert not any(k.startswith("general.sampling") for k in gguf.GGUFReader(plain).fields)
    assert raw_sampling_defaults(plain) == ({}, None)


def test_the_builtin_model_has_its_model_cards_defaults() -> None:
    defaults = load_generation_defaults(DEFAULT_MODEL)
    assert dict(defaults.values) == {"temperature": 0.2, "top_p": 0.9}
    assert "model card" in (defaults.source or "")


# ---------------------------------------------------------------- --chat-template


SIMPLE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_chat_template_from_a_file_or_inline(tmp_path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(SIMPLE, encoding="utf-8")
    assert load_chat_template(str(f)) == SIMPLE
    assert load_chat_template(SIMPLE) == SIMPLE  # inline: it has '{'
    assert load_chat_template("{{ '</s>' }}") == "{{ '</s>' }}"  # a slash inside a template is not a path
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(load_chat_template(str(f)), msgs) == "[user] hi\n[assistant]"


@pytest.mark.parametrize("value,message", [
    ("missing.jinja", "names no file"),
    ("templates/chat.j2", "names no file"),
    ("{% if %}", "does not compile"),
    ("{{ messages", "does not compile"),
    ("{" * 5000, "nested too deeply"),
    ("  \n ", "empty template"),
])
def test_bad_chat_templates_are_refused_in_one_line(value: str, message: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        load_chat_template(value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_chat_template_files_are_refused(tmp_path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    binary = tmp_path / "bin.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    for path, message in ((bad, "does not compile"), (binary, "cannot read"), (tmp_path, "is not a file")):
        with pytest.raises(ChatTemplateError) as info:
            load_chat_template(str(path))
        assert message in str(info.value) and "\n" not in str(info.value)
