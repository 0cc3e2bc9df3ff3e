"""Constrained decoding: a request's `StructuredOutput` compiled by xgrammar into a per-token mask.

    StructuredOutput --GrammarBackend.submit--> Future[compiled grammar]
        (compiled in the grammar compiler process, `executor.grammar_compiler`, cached here)
        --GrammarBackend.grammar--> Grammar (one xgrammar matcher per completion)
    each step: Grammar.fill -> bitmask [B, ceil(V/32)] --apply_grammar_masks--> logits of disallowed ids = -inf
               Grammar.accept(sampled id) advances the matcher

Why it is built this way:
- xgrammar compiles a grammar against the tokenizer's whole vocabulary once (JSON Schema, regex and
  EBNF alike); the per-token work is then a bitmask fill. Compiling takes milliseconds for most specs
  but can take minutes for a few small ones (a JSON Schema `pattern` `^[a-z]{1,26000}$`: 99 s), and
  xgrammar cannot be interrupted. So compiles run in a child process, several at once (a slow one
  holds up no other), while the engine's step loop goes on serving; a compile that outlives its time
  limit (`--grammar-compile-timeout`) fails its request with a 400, and the process is killed and
  replaced, the other compiles under way resent to the new one (from their start: each such stop fails
  the spec that outlived the limit, so no slow spec outlives it by its neighbours' stops).
- The compiled grammars are cached here, keyed by the spec (one backend per engine, i.e. per tokenizer,
  so "cached by (schema, tokenizer)" holds), up to `_CACHE_BYTES`; identical specs compiling at once
  share one compile. The compiler process and the tokenizer's view (`TokenizerInfo`) are built on the
  first constrained request, so a server that never sees one pays nothing.
- The mask is applied to the fp32 logits before every other processor: the log-probabilities the
  client sees are those of the constrained distribution, and a masked token stays at -inf whatever
  bias, penalty or temperature comes after.
- xgrammar ends a document only on one of the stop ids it was given (the model's EOS ids): EOS is
  allowed exactly where the grammar can end. The tokenizer's other special tokens (`<|im_start|>`, ...)
  are never allowed: xgrammar is told they are special, not text.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from typing import Any

import numpy as np
import torch

from executor.grammar_compiler import decode, encode
from executor.grammar_compiler import reason as _reason

logger = logging.getLogger("mlaserve.grammar")

_CACHE_BYTES = 256 << 20  # compiled grammars kept
_REFUSED_KEPT = 256  # specs refused for themselves, remembered (one compile each, however often sent)
_COMPILE_WORKERS = 8  # compiles at once: slow ones share the CPU instead of holding up the rest
DEFAULT_COMPILE_TIMEOUT_S = 30.0
_MAX_CRASHES = 2  # a spec under way when the compiler process died this often (by itself) is refused
# a spec sent to processes that died before they began it (sent to one already dead, say) this often: the
# processes themselves are failing, not the spec; it fails rather than being resent for ever
_MAX_ORPHANED = 4
# with a time limit, how long past it a spec sent to the compiler process may wait to begin: it waits for
# the process's start and a free worker (a compile past the limit frees one), unless the process is
# stopped or frozen
_START_GRACE_S = 30.0


class GrammarError(ValueError):
    """A spec the grammar engine refuses; `param` is the request parameter it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class Grammar:
    """One completion's position in its grammar (an xgrammar `GrammarMatcher`). With `after` (a
    reasoning model's `</think>` ids) the grammar sleeps until the output has produced them: until then
    every token is allowed and accepted, and the document starts right after them. `free`: the text may end
    wherever the grammar allows outside its tags (a structural tag), so min_tokens still holds its end off."""

    def __init__(self, matcher: Any, after: Sequence[int] = (), free: bool = False) -> None:
        self._matcher = matcher
        self._after = list(after)
        self._tail: list[int] = []  # the last len(after) tokens while asleep
        self.free = free

    @property
    def awake(self) -> bool:
        return not self._after

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the grammar does not allow it (the matcher is unchanged)."""
        if self._after:
            self._tail = (self._tail + [int(token_id)])[-len(self._after):]
            if self._tail == self._after:
                self._after = []
            return True
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """The document is complete (its stop id was accepted): nothing more may follow."""
        return self.awake and bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._after:
            bitmask[row].fill_(-1)  # asleep: every token
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def along(self, draft: Sequence[int], vocab_size: int) -> tuple[list[int], list[DraftMask]]:
        """The start of a speculative `draft` the grammar allows from here, and the mask of each position its
        verification samples (before each kept token, and after the last): position j is sampled as its own
        decode step would be, after the draft's first j tokens. A draft stops before a token the grammar
        refuses, and before one that completes the document (the verification samples that position anyway,
        and nothing may follow it). The grammar is left where it was (the matcher rolled back)."""
        import xgrammar as xgr

        saved = (list(self._after), list(self._tail))
        bitmask = xgr.allocate_token_bitmask(len(draft) + 1, vocab_size)
        stepped = kept = 0  # tokens the matcher took (not those taken asleep); tokens kept
        try:
            for j, tok in enumerate(draft):
                self.fill(bitmask, j)
                awake = self.awake
                # (the mask first: the matcher logs a warning for every special token it is offered)
                allowed = 0 <= tok < vocab_size and int(bitmask[j, tok >> 5]) >> (tok & 31) & 1
                if not allowed or not self.accept(tok):
                    break
                stepped += awake
                if self.terminated:
                    break
                kept += 1
            else:
                self.fill(bitmask, kept)
        finally:
            if stepped:
                self._matcher.rollback(stepped)
            self._after, self._tail = saved
        return list(draft[:kept]), [DraftMask(bitmask[j], self.free) for j in range(kept + 1)]


class DraftMask:
    """What a grammar allowed at one position of a speculative draft (`Grammar.along`), filled before the
    verification; the sampler reads it as it reads a grammar."""

    def __init__(self, words: torch.Tensor, free: bool = False) -> None:
        self.words = words  # one row of xgrammar's bitmask: bit t of the int32 words is token t
        self.free = free  # its grammar's (`Grammar.free`)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.words)


@dataclass(eq=False)
class _Job:
    """One spec being compiled, and every request waiting for it."""

    id: int
    kind: str
    spec: str
    waiters: list[tuple[Future, str]]  # (future, the request parameter the spec came from)
    sent: float = 0.0  # when it was sent to the current compiler process
    started: float | None = None  # when that process began it
    crashes: int = 0  # compiler processes that died by themselves while it was under way there
    orphaned: int = 0  # compiler processes that died by themselves before they began it

    @property
    def wanted(self) -> bool:
        """Some request still waits for it (the others were aborted: their futures cancelled)."""
        return any(not fut.done() for fut, _ in self.waiters)

    def fail(self, error: Exception | None, message: str = "") -> None:
        """Fails every waiter: with `error`, or a GrammarError naming each one's parameter before `message`."""
        for fut, param in self.waiters:
            if not fut.done():
                fut.set_exception(error if error is not None else GrammarError(param, f"{param}: {message}"))


class _CompilerProcess:
    """A running `executor.grammar_compiler`, the engine's ends of its two pipes, and a thread reading
    its answers into `inbox` (so that a process stopped halfway through writing one holds up nothing)."""

    def __init__(self, info_json: Callable[[], str], threads: int, inbox: "queue.SimpleQueue",
                 wake: Connection) -> None:
        """Starts it, then builds the TokenizerInfo JSON it needs while it imports xgrammar (both take
        seconds: the first constrained request waits for the longer, not the sum)."""
        self.jobs: dict[int, _Job] = {}  # sent to it, not yet answered
        to_r, to_w = os.pipe()
        frm_r, frm_w = os.pipe()
        try:
            # in a process group of its own: a SIGTERM or SIGINT to the server's group (systemd, a terminal's
            # Ctrl-C, `kill -- -PGID`) is the server's to drain by, and killed it mid-shutdown, which read as a
            # crash (an ERROR, and a new compiler started while the engine stopped). It still dies with the
            # engine (PR_SET_PDEATHSIG) and takes a SIGTERM sent to it alone.
            self.proc = subprocess.Popen([sys.executable, "-m", "executor.grammar_compiler", str(to_r), str(frm_w)],
                                         pass_fds=(to_r, frm_w), stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            for fd in (to_r, to_w, frm_r, frm_w):
                os.close(fd)
            raise
        os.close(to_r)
        os.close(frm_w)
        self.to, self._frm = Connection(to_w, readable=False), Connection(frm_r, writable=False)
        threading.Thread(target=self._read, args=(inbox, wake), name="grammar-compiler-reader", daemon=True).start()
        try:
            self.to.send_bytes(encode({"threads": threads, "workers": _COMPILE_WORKERS}, info_json().encode()))
        except BaseException:  # no tokenizer info, or it ended at once
            self.stop()
            raise

    def _read(self, inbox: "queue.SimpleQueue", wake: Connection) -> None:
        """(this process, header, payload) for each answer, then (this process, None, b"") at its end."""
        while True:
            try:
                header, payload = decode(self._frm.recv_bytes())
            except (EOFError, OSError):
                header, payload = None, b""
            inbox.put((self, header, payload))
            try:
                wake.send_bytes(b"")
            except OSError:  # the backend is gone
                return
            if header is None:
                self._frm.close()
                return

    def send(self, job: _Job) -> None:
        self.jobs[job.id] = job
        job.sent, job.started = time.monotonic(), None
        self.to.send_bytes(encode({"id": job.id, "kind": job.kind, "spec": job.spec}))

    def stop(self) -> int | None:
        """Kills it (a compile cannot be interrupted otherwise); its exit code (negative: a signal). The
        reader thread then sees its end."""
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self.to.close()
        return code


_LIVE: "weakref.WeakSet[GrammarBackend]" = weakref.WeakSet()


@atexit.register
def _shut_down_all() -> None:
    """At exit, backends nobody shut down stop their process and thread (a test's module-wide engine):
    left to the interpreter's end, a thread inside a pipe write ended the process in std::terminate."""
    for backend in list(_LIVE):
        backend.shutdown()


class GrammarBackend:
    """Compiles specs for one tokenizer in a compiler process and makes matchers from the results.

    One thread (`grammar-compiler`) owns the process: it starts it, sends the specs `submit` queues,
    takes the answers its reader thread passes on, and enforces the time limit."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], threads: int | None = None,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer`; `vocab_size`: the logits' width (may exceed the
        tokenizer's vocabulary: those ids are never allowed); `stop_token_ids`: ids that end a document;
        `timeout_s`: the longest one spec may compile (0: no limit)."""
        if tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted({int(t) for t in stop_token_ids})
        self._threads = threads or max(1, (os.cpu_count() or 2) // 4)
        self.timeout_s = timeout_s
        self._info: Any = None  # xgrammar's TokenizerInfo, built on the first compile
        self._unavailable: str | None = None  # why no spec can be compiled for this tokenizer
        self._lock = threading.Lock()  # guards what follows; the compiler thread's own state is its own
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()  # spec -> why (the last _REFUSED_KEPT)
        self._cache_bytes = 0
        self._by_spec: dict[tuple[str, str], _Job] = {}  # compiling or queued
        self._queued: list[_Job] = []
        self._next_id = 0
        self._stopped = False
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # the reader threads' answers
        self._thread: threading.Thread | None = None
        self._proc: _CompilerProcess | None = None  # the compiler thread's
        _LIVE.add(self)

    def submit(self, kind: str, spec: str, param: str) -> Future:
        """The compiled grammar of a spec, as a future: done at once when cached; else it raises
        GrammarError naming `param` if the spec cannot be compiled (or compiles too long). Cancel the
        future when its request is aborted: a spec no request waits for is not begun."""
        fut: Future = Future()
        key = (kind, spec)
        with self._lock:
            if self._stopped:
                fut.set_exception(RuntimeError("the grammar backend is shut down"))
                return fut
            if key in self._cache:
                self._cache.move_to_end(key)
                fut.set_result(self._cache[key])
                return fut
            if key in self._refused:
                fut.set_exception(GrammarError(param, f"{param}: {self._refused[key]}"))
                return fut
            if self._unavailable is not None:
                fut.set_exception(GrammarError(param, f"{param}: {self._unavailable}"))
                return fut
            job = self._by_spec.get(key)
            if job is not None:
                job.waiters.append((fut, param))
                return fut
            self._next_id += 1
            job = self._by_spec[key] = _Job(self._next_id, kind, spec, [(fut, param)])
            self._queued.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-compiler", daemon=True)
                self._thread.start()
        self._wake_w.send_bytes(b"")
        return fut

    def compile(self, kind: str, spec: str, param: str) -> Any:
        """`submit`, waited for."""
        return self.submit(kind, spec, param).result()

    def grammar(self, compiled: Any, after: Sequence[int] = (), free: bool = False) -> Grammar:
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(compiled), after, free)

    @property
    def compiler_pid(self) -> int | None:
        """The compiler process's pid while one runs (for tests and diagnostics)."""
        proc = self._proc
        return proc.proc.pid if proc is not None and proc.proc.poll() is None else None

    def shutdown(self) -> None:
        """Stops the compiler process and thread; specs still waiting fail."""
        with self._lock:
            self._stopped = True
        self._wake_w.send_bytes(b"")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # --- the compiler thread ---

    def _run(self) -> None:
        while True:
            try:
                if not self._serve_once():
                    break
            except Exception as e:  # a bug here must neither leave requests waiting nor end the backend
                logger.exception("the grammar compiler thread failed; restarting the compiler process")
                self._fail_all(RuntimeError(f"the grammar compiler failed: {type(e).__name__}: {e}"))
        self._fail_all(RuntimeError("the grammar backend is shut down"))

    def _serve_once(self) -> bool:
        with self._lock:
            if self._stopped:
                return False
            queued, self._queued = self._queued, []
        for job in [j for j in queued if not j.wanted]:
            self._forget(job)
        if wanted := [j for j in queued if j.wanted]:
            self._send(wanted)
        if self._wake_r.poll(self._until_deadline()):
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
        while True:
            try:
                proc, header, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if proc is self._proc:  # (a stopped process's last words are ignored)
                self._answer(header, payload)
        self._enforce_limit()
        return True

    def _forget(self, job: _Job) -> None:
        """Drops a job from the specs compiling: it ended, or no request waits for it (all were aborted)."""
        key = (job.kind, job.spec)
        with self._lock:
            if self._by_spec.get(key) is job:
                del self._by_spec[key]

    def _send(self, jobs: list[_Job]) -> None:
        for attempt in range(2):  # a second try: the first may have been killed before it read its setup
            if self._proc is not None:
                break
            try:
                self._proc = _CompilerProcess(self._tokenizer_info, self._threads, self._inbox, self._wake_w)
            except Exception as e:
                unavailable = self._unavailable
                if not unavailable and not attempt:
                    logger.warning("the grammar compiler process could not start (%s: %s); trying again",
                                   type(e).__name__, e)
                    continue
                for job in jobs:
                    self._finish(job, None, unavailable or "", None if unavailable else
                                 RuntimeError(f"the grammar compiler process could not start: {type(e).__name__}: {e}"))
                if not unavailable:
                    logger.exception("the grammar compiler process could not start")
                return
        for job in jobs:
            try:
                self._proc.send(job)
            except OSError:  # it died: its reader reports the end, and the job is resent
                pass

    def _tokenizer_info(self) -> str:
        """The tokenizer as xgrammar's TokenizerInfo, serialized for the compiler process."""
        if self._info is None:
            try:
                self._info = self._build_tokenizer_info()
            except Exception as e:  # a tokenizer xgrammar cannot read: no request can be constrained
                logger.exception("the grammar engine could not be built for this tokenizer")
                with self._lock:
                    self._unavailable = ("constrained decoding is not available for this model's tokenizer "
                                         f"({type(e).__name__}: {_reason(e)})")
                raise
        return self._info.serialize_json()

    def _build_tokenizer_info(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
        # The tokenizer's special tokens as xgrammar's (an empty text): it never allows them. Read as
        # text, `<|im_start|>` fitted inside a JSON string and an EOS's text matched a regex's `.+`
        # as the first token, ending the document empty (tests/executor/test_grammar.py).
        special = {i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        if special:
            vocab = [b"" if i in special else text for i, text in enumerate(info.decoded_vocab)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=self._stop_ids, add_prefix_space=info.add_prefix_space)
        logger.info("grammar engine ready: %s vocabulary of %d", info.vocab_type.name.lower(), info.vocab_size)
        return info

    def _answer(self, header: dict[str, Any] | None, payload: bytes) -> None:
        """One answer of the current compiler process; None: its end (it died)."""
        proc = self._proc
        assert proc is not None
        if header is None:
            self._restart(killed=[])
        elif "start" in header:
            if (job := proc.jobs.get(header["start"])) is not None:
                job.started = time.monotonic()
        elif "done" in header:
            if (job := proc.jobs.pop(header["done"], None)) is not None:
                self._done(job, payload)
        elif (job := proc.jobs.pop(header["error"], None)) is not None:
            internal = header.get("internal")
            self._finish(job, None, f"the {_kind(job)} cannot be compiled: {header['message']}",
                         RuntimeError(f"the grammar compiler failed: {header['message']}") if internal else None)

    def _done(self, job: _Job, payload: bytes) -> None:
        import xgrammar as xgr

        try:
            compiled = xgr.CompiledGrammar.deserialize_json(payload.decode(), self._info)
        except Exception as e:
            self._finish(job, None, "", RuntimeError(f"a compiled grammar could not be read: {type(e).__name__}: {e}"))
            return
        if _accepts_nothing(compiled, self.vocab_size):
            self._finish(job, None, f"the {_kind(job)} accepts no text at all (no token, not even the end, can "
                                    "start it: a rule that only refers to itself, for instance); give it a rule "
                                    "that matches something")
            return
        self._finish(job, compiled)

    def _finish(self, job: _Job, compiled: Any, message: str = "", error: Exception | None = None) -> None:
        """Ends a job: caches and hands out its grammar, or fails its waiters. (Cached before the job is
        dropped, so that a `submit` of the same spec meanwhile finds one or the other.) A spec refused for
        itself (`message`: it does not compile, or took past the time limit) is remembered as refused, so
        that sending it again costs no second compile (a slow one: another --grammar-compile-timeout of a
        core)."""
        if compiled is None:
            if error is None and message:
                with self._lock:
                    self._refused[(job.kind, job.spec)] = message
                    while len(self._refused) > _REFUSED_KEPT:
                        self._refused.popitem(last=False)
            self._forget(job)
            job.fail(error, message)
            return
        with self._lock:
            self._cache[(job.kind, job.spec)] = compiled
            self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        self._forget(job)
        for fut, _ in job.waiters:
            if not fut.done():
                fut.set_result(compiled)

    def _until_deadline(self) -> float | None:
        """Seconds until the first compile under way reaches the time limit, or a spec sent has waited
        too long to begin (None: nothing sent, or no limit). At most a minute: the loop looks again."""
        if self._proc is None or not self.timeout_s or not self._proc.jobs:
            return None
        now = time.monotonic()
        left = [self.timeout_s - (now - j.started) if j.started is not None
                else self.timeout_s + _START_GRACE_S - (now - j.sent) for j in self._proc.jobs.values()]
        return min(60.0, max(0.0, min(left)) + 0.01)

    def _enforce_limit(self) -> None:
        if self._proc is None or not self.timeout_s:
            return
        now = time.monotonic()
        jobs = self._proc.jobs.values()
        late = [j for j in jobs if j.started is not None and now - j.started >= self.timeout_s]
        if late:
            self._restart(killed=late)
        elif any(j.started is None and now - j.sent >= self.timeout_s + _START_GRACE_S for j in jobs):
            logger.error("the grammar compiler process began no compile for %g s: it is stopped or frozen",
                         self.timeout_s + _START_GRACE_S)
            self._restart(killed=[])

    def _restart(self, killed: list[_Job]) -> None:
        """Stops the compiler process (its `killed` jobs outlived the time limit; with none, it died or
        froze by itself), fails those jobs and resends the others to a new one, from the start (each
        stop fails a job that outlived the limit, so a slow spec cannot outlive it by the others')."""
        proc, self._proc = self._proc, None
        assert proc is not None
        code = proc.stop()
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        resend = []
        for job in proc.jobs.values():
            began = job.started is not None
            if any(job is k for k in killed):
                self._finish(job, None, f"the {_kind(job)} took longer than {self.timeout_s:g} s to compile (the "
                             "server's --grammar-compile-timeout); simplify it: large bounded repetitions such as "
                             "{1,10000} in a pattern or regex are slow to compile")
                continue
            if not killed:  # it died by itself: a spec it was compiling may be why (memory), one it was not is not
                if began:
                    job.crashes += 1
                    if job.crashes >= _MAX_CRASHES:
                        self._finish(job, None, f"the {_kind(job)} cannot be compiled: the compiler process ended "
                                     f"twice while compiling it (the last time: {how}; out of memory?)")
                        continue
                else:
                    job.orphaned += 1
                    if job.orphaned >= _MAX_ORPHANED:
                        self._finish(job, None, "", RuntimeError(f"the grammar compiler process ended ({how})"))
                        continue
            if job.wanted:
                resend.append(job)
            else:
                self._forget(job)
        if killed:
            logger.warning("a grammar compile outlived --grammar-compile-timeout (%g s): compiler process restarted",
                           self.timeout_s)
        elif code in (-signal.SIGTERM, -signal.SIGINT):  # stopped on purpose, by someone: not a crash
            logger.warning("the grammar compiler process was stopped (%s); restarting it", how)
        else:
            logger.error("the grammar compiler process ended (exit code %s); restarting it", code)
        if resend:
            self._send(resend)

    def _fail_all(self, error: Exception) -> None:
        """Stops the process and fails every spec still waiting (the thread's end, or a bug in it)."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        with self._lock:
            jobs = list(self._by_spec.values())
            self._by_spec.clear()
            self._queued.clear()
        for job in jobs:
            job.fail(error)


def _accepts_nothing(compiled: Any, vocab_size: int) -> bool:
    """Whether a compiled grammar allows no first token, its end included (`root ::= root`): xgrammar
    compiles such a grammar, and a request under it would have nothing to sample from its first step."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return not bool(bitmask.any())


def _kind(job: _Job) -> str:
    return job.kind.replace("_", " ")


def apply_grammar_masks(x: torch.Tensor, grammars: Sequence[Grammar | DraftMask | None]) -> None:
    """Sets x[i, t] = -inf for every token t that grammars[i] does not allow next (rows with None
    are left alone). x: fp32 [B, V], changed in place.

    On the CPU the bitmask is unpacked by numpy and applied with one masked copy per row: 4-5x faster
    than xgrammar's own CPU kernel on a 49k vocabulary (0.7 vs 3.1 ms for 16 rows, this 2-core box)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar as xgr

    vocab = x.shape[1]
    bitmask = xgr.allocate_token_bitmask(x.shape[0], vocab)  # row i for x's row i (xgrammar's `indices`)
    for i in rows:
        grammars[i].fill(bitmask, i)  # type: ignore[union-attr]
    if x.device.type != "cpu":
        xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device, non_blocking=True), vocab_size=vocab, indices=rows)
        return
    # bit t of the little-endian int32 words is token t: unpack their bytes least-significant bit first
    words = bitmask.numpy()[rows]
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(bool)
    xn = x.numpy()
    for j, i in enumerate(rows):
        np.copyto(xn[i], -np.inf, where=~allowed[j])
