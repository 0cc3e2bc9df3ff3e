"""Streamed chat logprobs (`ChatSerializer.placed_logprobs`): a delta's logprobs are those of the tokens that
start inside the answer text it sends, as the whole reply's `content_logprobs` are. A speculative step's delta
holds several tokens, some of whose text went to reasoning or to a tool call's markup: their logprobs were sent
with the answer text of the same delta (a probe found it), and the `</think>` tokens' were streamed though the
whole reply leaves them out."""

from __future__ import annotations

from types import SimpleNamespace

from server.choices import ShownLogprob
from server.responses import ChatSerializer


def serializer() -> ChatSerializer:
    ser = object.__new__(ChatSerializer)  # (only the streamed-logprob state: no server behind it)
    ser.body = SimpleNamespace(logprobs=True)
    ser.unplaced, ser.texts, ser.answered = {}, {}, {}
    return ser


def tokens(pieces: list[str], start: int = 0) -> list[ShownLogprob]:
    out, at = [], start
    for p in pieces:
        out.append(ShownLogprob(p, at))  # (the token's text stands for its logprob here)
        at += len(p)
    return out


def test_reasoning_and_its_end_in_the_answers_delta_are_left_out():
    ser = serializer()
    first = [" I", " read"]
    assert ser.placed_logprobs(0, tokens(first), "".join(first), "", elsewhere=True) == []
    step = [" Alice", ".", "</", "think", ">", '{"', "name"]  # one speculative step: reasoning, its end, answer
    got = ser.placed_logprobs(0, tokens(step, len(" I read")), "".join(step), '{"name', elsewhere=True)
    assert [lp for lp, _ in got] == ['{"', "name"]


def test_a_calls_markup_after_the_answer_waits_and_is_dropped_with_the_call():
    ser = serializer()
    step = [" it", " now", ".", " <", "tool", "_", "call", ">"]  # the parser holds " <..." back
    got = ser.placed_logprobs(0, tokens(step), "".join(step), " it now.", elsewhere=False)
    assert [lp for lp, _ in got] == [" it", " now", "."]
    assert ser.placed_logprobs(0, [], "\n{", "", elsewhere=True) == []  # the call began: the markup goes
    assert ser.unplaced[0] == []


def test_held_back_text_that_turns_out_answer_brings_its_tokens():
    ser = serializer()
    step = [" a", " <", "b"]
    assert [lp for lp, _ in ser.placed_logprobs(0, tokens(step), "".join(step), " a", elsewhere=False)] == [" a"]
    got = ser.placed_logprobs(0, tokens(["!"], 5), "!", " <b!", elsewhere=False)  # not a call after all
    assert [lp for lp, _ in got] == [" <", "b", "!"]


def test_a_token_whose_text_a_stop_string_cut_comes_with_no_new_text():
    """" is" with the stop string "is P": its space went out with " France"'s delta (the rest held back as a
    possible stop), so it was released only when the stop string ended the choice, with no new text; its
    logprob goes then (it was dropped). Tokens released with no text that start past the answer still wait."""
    ser = serializer()
    step = ["The", " capital", " of", " France"]
    assert [lp for lp, _ in ser.placed_logprobs(0, tokens(step), "".join(step), "".join(step), elsewhere=False)] == step
    assert ser.placed_logprobs(0, [], " ", " ", elsewhere=False) == []  # " is" not released yet
    got = ser.placed_logprobs(0, tokens([" is"], len("The capital of France")), "", "", elsewhere=False)
    assert [lp for lp, _ in got] == [" is"]
    later = tokens(["!"], len("The capital of France "))
    assert ser.placed_logprobs(0, later, "", "", elsewhere=False) == [] and ser.unplaced[0] == later
