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
    ser.wants_logprobs = True  # (what __init__ reads off the body)
    ser.state = SimpleNamespace(tokenizer=None)
    ser.unplaced, ser.texts, ser.answered, ser.floor = {}, {}, {}, {}
    return ser


def tokens(pieces: list[str], start: int = 0) -> list[ShownLogprob]:
    out, at = [], start
    for p in pieces:
        out.append(ShownLogprob(p, at, at + len(p)))  # (the token's text stands for its logprob here)
        at += len(p)
    return out


def test_reasoning_and_its_end_in_the_answers_delta_are_left_out():
    ser = serializer()
    first = [" I", " read"]
    assert ser.placed_logprobs(0, tokens(first), "".join(first), "", elsewhere=True) == []
    step = [" Alice", ".", "</", "think", ">", '{"', "name"]  # one speculative step: reasoning, its end, answer
    got = ser.placed_logprobs(0, tokens(step, len(" I read")), "".join(step), '{"name', elsewhere=True)
    assert [lp for lp, *_ in got] == ['{"', "name"]


def test_a_calls_markup_after_the_answer_waits_and_is_dropped_with_the_call():
    ser = serializer()
    step = [" it", " now", ".", " <", "tool", "_", "call", ">"]  # the parser holds " <..." back
    got = ser.placed_logprobs(0, tokens(step), "".join(step), " it now.", elsewhere=False)
    assert [lp for lp, *_ in got] == [" it", " now", "."]
    assert ser.placed_logprobs(0, [], "\n{", "", elsewhere=True) == []  # the call began: the markup goes
    assert ser.unplaced[0] == []


def test_held_back_text_that_turns_out_answer_brings_its_tokens():
    ser = serializer()
    step = [" a", " <", "b"]
    assert [lp for lp, *_ in ser.placed_logprobs(0, tokens(step), "".join(step), " a", elsewhere=False)] == [" a"]
    got = ser.placed_logprobs(0, tokens(["!"], 5), "!", " <b!", elsewhere=False)  # not a call after all
    assert [lp for lp, *_ in got] == [" <", "b", "!"]


def test_a_token_whose_text_a_stop_string_cut_comes_with_no_new_text():
    """" is" with the stop string "is P": its space went out with " France"'s delta (the rest held back as a
    possible stop), so it was released only when the stop string ended the choice, with no new text; its
    logprob goes then (it was dropped). Tokens released with no text that start past the answer still wait."""
    ser = serializer()
    step = ["The", " capital", " of", " France"]
    assert [lp for lp, *_ in ser.placed_logprobs(0, tokens(step), "".join(step), "".join(step), elsewhere=False)] == step
    assert ser.placed_logprobs(0, [], " ", " ", elsewhere=False) == []  # " is" not released yet
    got = ser.placed_logprobs(0, tokens([" is"], len("The capital of France")), "", "", elsewhere=False)
    assert [lp for lp, *_ in got] == [" is"]
    later = tokens(["!"], len("The capital of France "))
    assert ser.placed_logprobs(0, later, "", "", elsewhere=False) == [] and ser.unplaced[0] == later


def test_a_token_whose_first_characters_went_out_before_it_comes_with_the_rest():
    """"The" with a stop string starting at its "e": "Th" went out, "e" was held back; the token was released
    with the next delta ("e Roman") and, starting before that delta's text, was dropped (a probe found it)."""
    ser = serializer()
    assert ser.placed_logprobs(0, [], "Th", "Th", elsewhere=False) == []
    got = ser.placed_logprobs(0, tokens(["The", " Roman"]), "e Roman", "e Roman", elsewhere=False)
    assert [lp for lp, *_ in got] == ["The", " Roman"]


def test_the_whole_replys_logprobs_keep_the_answers_first_token_whose_space_was_stripped():
    """After `</think>` the reasoning parser strips the answer's leading space: " Instance"'s text starts one
    character before the answer, and the whole reply left it out."""
    from server.reasoning import Split

    ser = serializer()
    ser.texts = {0: "</think> Instance dt"}
    got = ser.content_logprobs(0, tokens(["</think>", " Instance", " dt"]), Split("", "Instance dt"), "Instance dt")
    assert [lp for lp, *_ in got] == [" Instance", " dt"]


def test_an_end_of_reasoning_with_no_reasoning_is_left_out_of_the_answers_logprobs():
    """`</think>` ending an empty reasoning went nowhere, but, with no reasoning text beside it, its logprob
    waited and was sent with the answer's first token, each later one's shifted by one (a probe found it with
    a repeated `</think>`)."""
    ser = serializer()
    ser.reasoning_kind, ser.reasoners, ser.n = "deepseek_r1", {}, 1
    ser.prompts, ser.tag_ids, ser.call_id = [([], "<｜User｜>hi<｜Assistant｜><think>\n")], None, None
    ser.tools = SimpleNamespace(new_parser=None)
    r = SimpleNamespace(prompt_index=0, choices=[SimpleNamespace(finish_reason=None)])
    sent = []
    for k in range(3):
        reasoning, answer, _, _, lps = ser.placed_delta(r, 0, "</think>", [7], tokens(["</think>"], 8 * k))
        sent.append((answer, [off for _, off, _ in lps]))
    assert sent == [("", []), ("</think>", [8]), ("</think>", [16])]


def test_an_answer_that_starts_like_the_end_tag_is_found_after_it():
    """A stop string held back the `>` of the `</think>` that ended the reasoning: the delta that ended it held
    `>` and the answer `</think` (the model wrote the tag again), and the answer was found inside the tag, its
    logprobs one token early from there on (a review found it)."""
    ser = serializer()
    assert ser.placed_logprobs(0, tokens(["Hm"]), "Hm</think", "", elsewhere=True) == []
    # the first tag's text is whole now: released, and dropped (the answer starts after it)
    assert ser.placed_logprobs(0, tokens(["</think>"], 2), "></think", "</think", elsewhere=True, ended=True) == []
    got = ser.placed_logprobs(0, tokens(["</think>"], 10), ">", ">", elsewhere=False)  # the second, whole
    assert [off for _, off, _ in got] == [10]
