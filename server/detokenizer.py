"""Streaming text out of token ids, in the server process, one pair of objects per completion.

    new token ids --IncrementalDetokenizer.add--> new text --StopStringMatcher.feed--> text to send
    at the end:     IncrementalDetokenizer.flush --> StopStringMatcher.feed, then StopStringMatcher.flush

What each one holds back, and why:

`IncrementalDetokenizer` decodes a small window of ids, not the whole sequence (the prefix/read
offset scheme of TGI and vLLM): `ids[prefix:read]` were sent before and give context, so that
decoders whose output depends on neighbours (a SentencePiece leading space, byte tokens that only
form a character together) produce the same text as a full decode; `ids[read:]` are new. The text
of the window past what was already sent is the delta; the window then moves on (prefix = read,
read = end), so each call decodes a few tokens, whatever the length of the completion.
  * Byte-level tokenizers split characters: a token may carry the first bytes of a UTF-8 character
    whose rest comes with the next tokens. The decoder then ends its text with U+FFFD. While the
    window's text ends with U+FFFD, the window does not move and the trailing run of U+FFFD is held
    back (what precedes it cannot change any more, so it is sent).
  * Skipped special tokens never enter the window (the decode leaves them out anyway); new tokens with
    no visible text (a lone SentencePiece `▁`) do not move the window: a window starting there would
    strip the space the next word needs.
  * A sequence that truly contains invalid bytes would hold forever, and the window would grow
    with every token. So after `MAX_HELD_TOKENS` held tokens we look, among the last few token
    boundaries, for the last *sealed* one q, where no character straddles q: the text before q ends
    in a real character (the UTF-8 decoder has nothing pending), or, for byte-level decoders (lossy
    UTF-8 over the whole byte stream), both sides decoded apart give the text decoded together. We
    send the text before q and read on from q. If none exists the text is taken as it is. Valid
    text never takes this path: a character has at most 4 bytes, so it completes (and the window
    moves) within 4 byte-carrying tokens.
  * `flush()` sends whatever is held, replacement characters included: the sequence really ended
    in the middle of a character.
Window starts are always sealed, so the concatenated deltas equal `tokenizer.decode(all_ids)` (with
`prompt_ids`: the text the ids add after the prompt, whose trailing byte-fallback tokens are left out of
the context; a character the prompt's last bytes begin and the ids finish is theirs, as in vLLM; the U+FFFD of one they do not finish
stay the prompt's). One exception, invalid bytes in SentencePiece byte-fallback runs: the HF `ByteFallback`
decoder turns a whole run of `<0xNN>` tokens into U+FFFD when any byte of it is invalid, so a later
stray byte would change text already sent.

`StopStringMatcher` runs one KMP automaton per stop string over the text as it arrives (linear in
the text, whatever the chunking). It holds back the longest suffix that is a prefix of some stop
string, since the next text may complete it; everything before that suffix can be sent. Of the stop
strings completed in the text fed at once (a token's), the one that starts first wins; text up to its
start is sent and nothing after it. When the completion ends without a hit, `flush()` sends the held
suffix.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence

from tokenizers import decoders

from models.loader.tokenizer import TokenizerBundle

REPLACEMENT = "\ufffd"  # what decoders put where bytes are not (yet) a valid UTF-8 character
MAX_HELD_TOKENS = 8  # held tokens before we look for a sealed boundary (a character is <= 4 bytes)
PROMPT_CONTEXT_TOKENS = 5  # prompt ids kept as decoding context when `prompt_ids` is given
MAX_PROMPT_BYTE_RUN = 4096  # prompt byte-fallback tokens looked past for that context (a longer run: none)


class IncrementalDetokenizer:
    """Text deltas of one completion's token ids. Not thread-safe; one per completion."""

    def __init__(self, tokenizer: TokenizerBundle, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), keep: frozenset[int] = frozenset()) -> None:
        """`prompt_ids`: give them to decode the first tokens as they read after the prompt (a
        SentencePiece leading space is kept); without them the text is `decode(generated ids)`. `keep`:
        special tokens whose text shows even when skipping (a tool-call parser's markup)."""
        self._tok = tokenizer.tokenizer
        # left out of the window when skipped, as the decode leaves them out: a run of them would otherwise
        # start a window and strip the space of the SentencePiece word after it
        self._skipped = tokenizer.special_ids - keep if skip_special_tokens else frozenset()
        # with tokens to keep, the decode skips nothing: the others never enter the window
        self._skip = skip_special_tokens and not (keep & tokenizer.special_ids)
        # lossy UTF-8 over the whole byte stream: a boundary after a replacement character can be sealed
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        # a SentencePiece byte-fallback run is decoded as one (any invalid byte in it turns every byte to U+FFFD):
        # one ending the prompt would take in the first generated bytes and spoil the prompt's own text. The
        # context is the few ids before the prompt's trailing run (their text keeps the first word's leading
        # space), then only the bytes of a character the run leaves unfinished (a token-id prompt cut inside one)
        end, lowest = len(prompt_ids), max(0, len(prompt_ids) - MAX_PROMPT_BYTE_RUN)
        while end > lowest and tokenizer.is_byte_fallback(prompt_ids[end - 1]):
            end -= 1
        before: Sequence[int] = ()
        if end and not tokenizer.is_byte_fallback(prompt_ids[end - 1]):  # (a longer run: no context before it)
            before = prompt_ids[max(0, end - PROMPT_CONTEXT_TOKENS):end]
        self._ids: list[int] = [*before, *_unfinished_tail(list(prompt_ids[end:]), tokenizer)]
        self._prefix = 0  # window start: a sealed position; everything before it was sent
        self._read = len(self._ids)  # sealed; the window's text up to here was sent
        self._sent = len(self._decode(0, self._read))  # characters of the window's text already sent
        # a prompt cut inside a character (token-id prompts): the tokens holding its first bytes are read again
        # with the completion's, as generated ones would be; a character the completion's bytes finish is the
        # completion's, while the prompt's U+FFFD stay the prompt's when they do not (`_settle`)
        self._unfinished: str | None = None  # the prompt's text, ending in its U+FFFD, until that is known
        self._prompt_end = self._read  # where the completion's ids begin in the window
        context = self._decode(0)
        if context.endswith(REPLACEMENT):
            q = _pending_start(self._ids, tokenizer)
            if q is not None:
                # nothing past the prompt's text is sent until `_settle` knows whose its U+FFFD are
                self._read, self._sent, self._unfinished = q, len(context.rstrip(REPLACEMENT)), context

    def shows(self, token_id: int) -> bool:
        """Whether this id's own text can appear in the output (special tokens are skipped unless asked for)."""
        return token_id not in self._skipped

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, ids: Sequence[int]) -> str:
        """The text that `ids` (appended to those before) add, minus what must wait for later tokens."""
        ids = [i for i in ids if i not in self._skipped] if self._skipped else ids
        if not ids:
            return ""
        self._ids.extend(ids)
        text = self._decode(self._prefix)
        held = len(self._ids) - self._read
        self._settle(final=False)
        if text.endswith(REPLACEMENT):  # the last character may be incomplete
            if held <= MAX_HELD_TOKENS:
                return self._send_upto(text, len(text.rstrip(REPLACEMENT)))
            return self._send_to_sealed_boundary(text)
        if len(text) <= self._sent and held <= MAX_HELD_TOKENS:
            return ""  # nothing visible yet (special tokens, a lone SentencePiece space): keep the context
        return self._send_and_move(text, len(self._ids))

    def flush(self) -> str:
        """Everything still held; call once when the completion ends."""
        self._settle(final=True)
        return self._send_and_move(self._decode(self._prefix), len(self._ids))

    def _settle(self, final: bool) -> None:
        """Whose the U+FFFD of a prompt cut inside a character are, once the completion's first ids tell (a
        character has at most 3 bytes more, so at most 3 ids): its bytes finished the character (the text no
        longer begins with the prompt's; the character and what follows are the completion's), or they did
        not (text past the prompt's U+FFFD, 3 ids seen, or the completion ended) and the U+FFFD stay the
        prompt's, already sent with it: the completion's text is then the one its ids add after the prompt's,
        as a full decode of both has it. Only the first ids are decoded: later invalid bytes in a SentencePiece
        run would turn the whole run, the finished character too, into U+FFFD."""
        if self._unfinished is None:
            return
        came = len(self._ids) - self._prompt_end
        for j in range(1, min(came, 3) + 1):
            text = self._decode(0, self._prompt_end + j)
            if not text.startswith(self._unfinished):  # finished: sent from where the two texts part
                self._sent, self._unfinished = len(os.path.commonprefix([self._unfinished, text])), None
                return
            if len(text.rstrip(REPLACEMENT)) > len(self._unfinished):
                break
        else:
            if came < 3 and not final:
                return
        self._sent, self._unfinished = max(self._sent, len(self._unfinished)), None

    def _send_upto(self, text: str, end: int) -> str:
        delta = text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

    def _send_and_move(self, text: str, to: int) -> str:
        """Sends `text` (the window's text up to `to`, sealed) past what was sent, then moves the window
        on: it now starts at the old read offset (context) and reads from `to`."""
        delta = text[self._sent:]
        beyond = max(0, self._sent - len(text))  # sent earlier from text past `to`
        self._prefix, self._read = self._read, to
        self._sent = len(self._decode(self._prefix, self._read)) + beyond
        if self._prefix > 1024:  # ids before the window are never decoded again
            del self._ids[:self._prefix]
            self._prefix, self._read = 0, self._read - self._prefix
        return delta

    def _send_to_sealed_boundary(self, text: str) -> str:
        """Held too long: sends up to the last sealed boundary q within reach, and reads on from q."""
        lowest = max(self._read, len(self._ids) - 2 * MAX_HELD_TOKENS)  # a valid character is <= 4 tokens
        heads = [(q, self._decode(self._prefix, q)) for q in range(len(self._ids) - 1, lowest, -1)]
        for q, head in heads:  # after a real character the decoder has nothing pending
            if head and not head.endswith(REPLACEMENT):
                return self._send_and_move(head, q)
        if self._byte_level:  # after a replacement character: sealed if the two sides decode apart alike
            for q, head in heads:
                tail = self._decode(q)
                if tail and head + tail == text:
                    return self._send_and_move(head, q)
        return self._send_and_move(text, len(self._ids))  # the replacement characters are for good


def _pending_bytes(data: bytes) -> int:
    """How many of `data`'s last bytes begin a character it does not finish (the UTF-8 decoder holds them)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return len(decoder.getstate()[0])


def _unfinished_tail(run: list[int], tokenizer: TokenizerBundle) -> list[int]:
    """The last byte-fallback tokens of `run` that begin a character the run does not finish (none when
    the run ends on a whole character)."""
    pending = _pending_bytes(b"".join(map(tokenizer.token_bytes, run)))  # one byte a token
    return run[len(run) - pending:] if pending else []


def _pending_start(ids: list[int], tokenizer: TokenizerBundle) -> int | None:
    """The token in which the character `ids` leave unfinished begins (the UTF-8 decoder's pending bytes; the
    token may hold bytes before them), or None when none is pending or it began more than 3 tokens back (a cut
    inside a character leaves at most 3 of its bytes)."""
    data = [tokenizer.token_bytes(i) for i in ids]
    pending = _pending_bytes(b"".join(data))
    if not pending:
        return None
    q, seen = len(ids), sum(map(len, data))
    begins = seen - pending  # its byte offset
    while q > 0 and seen > begins:
        q -= 1
        seen -= len(data[q])
    return q if len(ids) - q <= 3 else None


class StopStringMatcher:
    """Cuts a completion's text before the first stop string (`include`: right after it), never sending
    part of one before it is known to be one. Of the stop strings a token's text completes, the one
    that starts first cuts ("toile" before "oi" in "toile"), so the text holds none of them."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._include = include
        self._stops = [s for s in dict.fromkeys(stops) if s]  # "" would match before any text
        self._fail = [_kmp_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # per stop: length of its prefix the text now ends with
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that cut the text

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was hit). After a hit: ("", True).

        `armed=False`: no stop string may end in `text` (tokens before `min_tokens`, as vLLM); the
        automaton still reads it, so a stop string begun there can end in later text."""
        if self._stopped:
            return "", True
        buf = self._held + text
        base = len(self._held)
        hit: tuple[int, int, str] | None = None  # (start, end, stop) of the completed stop that starts first
        for i, ch in enumerate(text):
            for n, stop in enumerate(self._stops):
                k, fail = self._state[n], self._fail[n]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if armed and (hit is None or base + i + 1 - k < hit[0]):
                        hit = (base + i + 1 - k, base + i + 1, stop)
                    k = fail[k - 1]
                self._state[n] = k
        if hit is not None:
            self._stopped, self._held, self.matched = True, "", hit[2]
            return buf[: hit[1] if self._include else hit[0]], True
        keep = max(self._state, default=0)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held text, when the completion ended without a stop string ("" after a hit)."""
        held, self._held = self._held, ""
        self._state = [0] * len(self._stops)
        return "" if self._stopped else held


def _kmp_failure(s: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
