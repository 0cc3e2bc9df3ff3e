"""Reasoning parsers on outputs in the shape DeepSeek-R1 and Qwen3 write them: split at every position of
the stream (so `<think>` and `</think>` arrive cut in two at every place), fed a character at a time,
and whole, always the same reasoning and answer; blocks that never close; templates that choose."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.reasoning import ReasoningParser, Split, parser_kind, starts_in_reasoning

R1 = ("Okay, the user asks for 17 * 23. Let me compute: 17 * 20 = 340, 17 * 3 = 51, so 391.\n"
      "Wait, check: 23 * 17 = 391. Yes.\n</think>\n\n17 × 23 = **391**.")
R1_OLD_TEMPLATE = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
R1_CUT_OFF = "Let me think about this step by step. First, the integral of x^2 is x^3/3, then"
QWEN3 = "<think>\nThe user greets me. I should answer briefly.\n</think>\n\nHello! How can I help you today?"
QWEN3_NO_THINK = "Hello! How can I help you today? I never write <think> here, only mention it."
QWEN3_CUT_OFF = "<think>\nHmm, a long proof. Suppose n is even, then n = 2k and"

KIMI_SECTION = "<|tool_calls_section_begin|>"
KIMI_CALL = (KIMI_SECTION + "<|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>{\"arg1\": 1}"
             "<|tool_call_end|><|tool_calls_section_end|>")

CASES = [
    ("deepseek_r1", R1, R1.split("</think>")[0], "17 × 23 = **391**."),
    ("deepseek_r1", R1_OLD_TEMPLATE, "\nThe capital of France is Paris.\n", "Paris."),
    ("deepseek_r1", R1_CUT_OFF, R1_CUT_OFF, ""),
    ("qwen3", QWEN3, "\nThe user greets me. I should answer briefly.\n", "Hello! How can I help you today?"),
    ("qwen3", QWEN3_NO_THINK, "", QWEN3_NO_THINK),
    ("qwen3", QWEN3_CUT_OFF, "\nHmm, a long proof. Suppose n is even, then n = 2k and", ""),
    ("qwen3", "  \n<think></think>Just the answer", "", "Just the answer"),
    # a call opened inside the block ends it (Qwen3 opens calls without closing it): the call was reasoning
    ("qwen3", '<think>I should look up the weather. <tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
     "I should look up the weather. ", '<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'),
    ("deepseek_r1", "thinking <tool_call> still thinking", "thinking <tool_call> still thinking", ""),
    # Kimi-K2-Thinking: R1's reading, and its call section (or a bare call) ends an unclosed block, as vLLM's
    # kimi_k2 reasoning parser and llama.cpp's reading of its template end it; R1's kind keeps the call reasoning
    ("kimi_k2", "<think>I'm thinking about this</think>" + KIMI_CALL, "I'm thinking about this", KIMI_CALL),
    ("kimi_k2", "<think>I need the weather. " + KIMI_CALL, "I need the weather. ", KIMI_CALL),
    ("kimi_k2", "No tag, thinking. " + KIMI_CALL[len(KIMI_SECTION):], "No tag, thinking. ",
     KIMI_CALL[len(KIMI_SECTION):]),
    ("kimi_k2", "<think>a</think>\n\nHello <|tool_calls_sec", "a", "Hello <|tool_calls_sec"),
    ("kimi_k2", "<think>cut off while thinking about <|tool_call", "cut off while thinking about <|tool_call", ""),
    ("deepseek_r1", "thinking " + KIMI_CALL, "thinking " + KIMI_CALL, ""),
]


def run(kind: str, pieces: list[str], after: str | None = None, prompt: str | None = None) -> Split:
    """The split of `pieces` fed in turn; `after`: a continued message's text (the prompt ends with it),
    `prompt`: the prompt (default: an assistant turn opened, then `after`)."""
    p = ReasoningParser(kind)
    if after is not None or prompt is not None:
        p.after_prompt(prompt if prompt is not None else "<|Assistant|>" + (after or ""), after)
    out = Split()
    for piece in pieces:
        s = p.feed(piece)
        out.reasoning += s.reasoning
        out.content += s.content
    s = p.finish()
    return Split(out.reasoning + s.reasoning, out.content + s.content)


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_whole_and_every_split_agree(kind: str, text: str, reasoning: str, content: str) -> None:
    assert run(kind, [text]) == Split(reasoning, content)
    assert run(kind, list(text)) == Split(reasoning, content)  # a character at a time
    for i in range(len(text) + 1):  # cut in two at every position, tags included
        assert run(kind, [text[:i], text[i:]]) == Split(reasoning, content), i
    for i in range(0, len(text), 7):  # and in three
        assert run(kind, [text[:i], text[i:i + 3], text[i + 3:]]) == Split(reasoning, content), i


def test_a_held_back_tag_prefix_is_released_when_it_is_not_a_tag() -> None:
    p = ReasoningParser("deepseek_r1")
    assert p.feed("a < b and x </thi") == Split("a < b and x ", "")
    assert p.feed("ng>") == Split("</thing>", "")  # not the closing tag after all
    assert p.feed("</think>ok") == Split("", "ok")


def test_nothing_is_shown_before_it_is_decided() -> None:
    q = ReasoningParser("qwen3")
    assert q.feed("  <thi") == Split()  # may still open a block
    assert q.feed("nk>why") == Split("why", "")
    assert q.in_reasoning
    q2 = ReasoningParser("qwen3")
    assert q2.feed("<b>") == Split("", "<b>")
    assert not q2.in_reasoning


@pytest.mark.parametrize("choice,template,kind", [
    ("auto", "{% for m in messages %}{{ m.content }}{% endfor %}<|Assistant|><think>\n", "deepseek_r1"),
    ("auto", "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}", "qwen3"),
    ("auto", "{{ messages[0].content }}", "none"),
    ("auto", None, "none"),
    ("qwen3", "{{ messages[0].content }}", "qwen3"),
    ("none", "<think>", "none"),
    ("glm45", "{{ messages[0].content }}", "qwen3"),  # (vLLM's name for GLM-4.5 to 4.7: Qwen3's reading)
    # Kimi-K2-Thinking's template (its assistant turns and calls); Kimi-K2-Instruct's writes no <think>
    ("auto", "<|im_assistant|>assistant<|im_middle|><think>{{rc}}</think>{{render_content(message)}}"
             "{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
    ("auto", (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "kimi_k2.jinja").read_text(),
     "none"),
    ("kimi_k2", "{{ messages[0].content }}", "kimi_k2"),
])
def test_auto_reads_the_chat_template(choice: str, template: str | None, kind: str) -> None:
    assert parser_kind(choice, template) == kind


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("o1")


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("prefix, text, reasoning, content", [
    ("<think>\nLet me see", " more.</think>\n\nYes.", " more.", "Yes."),  # the prefix opened the block
    ("<think>a</think>", "\n\nYes.", "", "Yes."),  # closed right at the prefix's end: layout dropped
    ("<think>a</think>\n\nThe answer", " is 4.", "", " is 4."),
    ("The answer", " is 4.", "", " is 4."),  # no block: R1's implicit one is not opened either
])
def test_a_continued_message_starts_where_its_prefix_left_off(kind: str, prefix: str, text: str, reasoning: str,
                                                              content: str) -> None:
    """A continued final message (continue_final_message / prefix): the parser starts in the state its text
    leaves, whole or fed a character at a time."""
    assert run(kind, [text], prefix) == Split(reasoning, content)
    assert run(kind, list(text), prefix) == Split(reasoning, content)


@pytest.mark.parametrize("kind, prompt, prefix, inside", [
    ("deepseek_r1", "<|Assistant|>", None, True), ("qwen3", "assistant\n", None, False), ("none", "", None, False),
    ("deepseek_r1", "<|Assistant|>The answer", "The answer", False),
    ("deepseek_r1", "<|Assistant|><think>so", "<think>so", True), ("qwen3", "<think>so", "<think>so", True),
    ("qwen3", "<think>a</think>b", "<think>a</think>b", False), ("none", "<think>so", "<think>so", False),
    # the prompt's own last tag: R1's generation prompt, DeepSeek-V3.1's in either mode, Qwen3's thinking off
    ("deepseek_r1", "<|Assistant|><think>\n", None, True), ("deepseek_r1", "<|Assistant|></think>", None, False),
    ("deepseek_r1", "<|Assistant|><think>", None, True), ("qwen3", "<think>\n\n</think>\n\n", None, False),
    ("qwen3", "<think>\n", None, True),
    # a continued V3.1 reply: the tag the template wrote before it (thinking mode) decides
    ("deepseek_r1", "<|Assistant|><think>Let me", "Let me", True),
    ("deepseek_r1", "<|Assistant|></think>The answer", "The answer", False),
])
def test_where_a_constrained_answer_starts(kind: str, prompt: str, prefix: str | None, inside: bool) -> None:
    assert starts_in_reasoning(kind, prompt, prefix) is inside


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_closes_the_block_starts_the_answer(kind: str) -> None:
    """DeepSeek-V3.1's default (non-thinking) prompt ends with `</think>`: its output is the answer, the
    layout after the tag dropped, even for the R1 kind its template's `<think>` makes `auto` choose."""
    assert run(kind, list("\nParis is the capital."), prompt="<|User|>Capital?<|Assistant|></think>") == \
        Split("", "Paris is the capital.")
    assert run(kind, ["So it is", " Paris.</think>Paris."], prompt="<|User|>Capital?<|Assistant|><think>") == \
        Split("So it is Paris.", "Paris.")


def test_an_opened_prompt_drops_the_output_s_own_opening_tag() -> None:
    """A prompt that ends by opening the block (R1's, V3.1's thinking mode) and an output that opens it again:
    the tag is not reasoning text (it leaked into reasoning_content), as vLLM partitions it away."""
    for kind in ("deepseek_r1", "qwen3"):
        for pieces in (["<think>\nreasoning\n</think>\n\nanswer"], list("<think>\nreasoning\n</think>\n\nanswer")):
            got = run(kind, pieces, prompt="<｜Assistant｜><think>\n")
            assert (got.reasoning, got.content) == ("\nreasoning\n", "answer"), (kind, pieces[:2])
        got = run(kind, ["plain thought</think>answer"], prompt="<｜Assistant｜><think>\n")
        assert (got.reasoning, got.content) == ("plain thought", "answer")


def _reasoning_tokens(kind: str, tok, prompt: str, ids: list[int], group: int) -> int:
    """The count a chat choice reports when its ids arrive `group` at a time (text through the detokenizer)."""
    from server.detokenizer import IncrementalDetokenizer
    from server.reasoning import ChoiceReasoning, single_token_tags

    det = IncrementalDetokenizer(tok, skip_special_tokens=False)
    choice = ChoiceReasoning(kind, prompt, None, single_token_tags(lambda t: tok.encode(t, add_special_tokens=False)))
    for at in range(0, len(ids), group):
        part = ids[at:at + group]
        last = at + group >= len(ids)
        choice.feed(det.add(part) + (det.flush() if last else ""), part, last)
    return choice.tokens.count


def test_reasoning_tokens_do_not_depend_on_how_the_tokens_arrive() -> None:
    """`usage...reasoning_tokens` counted by the state before each delta: a delta that closed the block counted
    its answer tokens, and with qwen3 one that opened it counted nothing (0 for a whole reply in one delta).
    Where the tags are one token each (DeepSeek's tokenizer) the count is the tokens through `</think>`, however
    they are grouped; with several tokens a tag, a delta that gave reasoning counts."""
    from models.loader.tokenizer import deepseek_tokenizer_dir, load_hf_tokenizer, load_tokenizer

    ds = load_hf_tokenizer(deepseek_tokenizer_dir())
    for kind, prompt, text in (("deepseek_r1", "<｜Assistant｜><think>\n", "reasoning here, at length\n</think>\n\n"
                                "the answer is long text"),
                               ("qwen3", "<|im_start|>assistant\n", "<think>\nreasoning here\n</think>\n\nanswer text")):
        ids = ds.encode(text, add_special_tokens=False)
        through = ids.index(ds.tokenizer.token_to_id("</think>")) + 1
        assert {_reasoning_tokens(kind, ds, prompt, ids, g) for g in (1, 2, 3, 4, 8, len(ids))} == {through}, kind
    # whitespace before qwen3's <think> (the parser skips it, the count counted nothing: it opened only on the
    # output's first token): the tokens from <think> through </think>
    ids = ds.encode("\n\n<think>reasoning here</think>answer text", add_special_tokens=False)
    start, end = ids.index(ds.tokenizer.token_to_id("<think>")), ids.index(ds.tokenizer.token_to_id("</think>"))
    assert start > 0 and {_reasoning_tokens("qwen3", ds, "<|im_start|>assistant\n", ids, g)
                          for g in (1, 2, 3, len(ids))} == {end + 1 - start}
    # a <think> after text is the answer's, not a block
    ids = ds.encode("ok <think>no</think>", add_special_tokens=False)
    assert {_reasoning_tokens("qwen3", ds, "<|im_start|>assistant\n", ids, g) for g in (1, len(ids))} == {0}
    # qwen3's block ended by a tool call, no </think>: the tokens before the call; this tokenizer spells
    # `<tool_call>` in several tokens, so the count stops with the delta that completes it (it counted the
    # call's tokens and all after it; now at most the delta's tokens past the tag)
    think = ds.encode("<think>check the weather", add_special_tokens=False)
    tag = ds.encode("<tool_call>", add_special_tokens=False)
    ids = think + ds.encode('<tool_call>\n{"name": "w"}\n</tool_call>', add_special_tokens=False)
    assert len(tag) > 1
    for g in (1, 2, 3):
        count = _reasoning_tokens("qwen3", ds, "<|im_start|>assistant\n", ids, g)
        assert len(think) <= count <= len(think) + len(tag) + g - 1 < len(ids), (g, count)
    # where `<tool_call>` is one token (Qwen's tokenizers), by its id: exact, however the ids are grouped
    from server.reasoning import ReasoningTokens, Split as S

    for groups in ([[5, 6, 7, 8, 9]], [[5], [6, 7], [8, 9]]):
        counter = ReasoningTokens((1, 2), inside=True, call_id=7)
        for part in groups:
            counter.add(part, True, S("x", ""))
        assert counter.count == 2, groups
    try:
        smol = load_tokenizer("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ids = smol.encode("<think>\nreasoning here\n</think>\n\nanswer text", add_special_tokens=False)
    assert len(smol.encode("</think>", add_special_tokens=False)) > 1
    assert _reasoning_tokens("qwen3", smol, "<|im_start|>assistant\n", ids, len(ids)) == len(ids)  # one delta
    assert 0 < _reasoning_tokens("qwen3", smol, "<|im_start|>assistant\n", ids, 1) < len(ids)


GLM_CALL = "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>"


@pytest.mark.parametrize("file, thinking, output, reasoning, content", [
    # GLM-4.7-Flash's generation prompt opens the block (`<|assistant|><think>`) unless thinking is off (then it
    # closes it): llama.cpp's test-chat.cpp reads these outputs of its template so ("forced-open" thinking)
    ("glm_4_7_flash.jinja", None, "I'm\nthinking</think>Hello, world!\nWhat's up?", "I'm\nthinking",
     "Hello, world!\nWhat's up?"),
    ("glm_4_7_flash.jinja", None, "I'm\nthinking</think>" + GLM_CALL, "I'm\nthinking", GLM_CALL),
    ("glm_4_7_flash.jinja", False, "Hello, world!\nWhat's up?", "", "Hello, world!\nWhat's up?"),
    ("glm_4_7_flash.jinja", False, GLM_CALL, "", GLM_CALL),
    # GLM-4.5/4.6's leaves `<think>` to the model (its history turns are `<|assistant|>\n<think>...</think>\n...`),
    # or closes the block in the prompt (`<think></think>`) where thinking is off
    ("glm_4_6.jinja", None, "\n<think>I'm\nthinking</think>\nHello, world!", "I'm\nthinking", "Hello, world!"),
    ("glm_4_6.jinja", None, "\n<think></think>\n" + GLM_CALL, "", GLM_CALL),
    ("glm_4_6.jinja", False, "\nHello, world!", "", "Hello, world!"),
])
def test_glm_templates_choose_where_the_reasoning_is(file, thinking, output, reasoning, content) -> None:
    """`auto` reads GLM-4.5 to 4.7's templates as Qwen3's kind (the model opens the block, `enable_thinking`
    switches it), and the rendered prompt's last tag says where the output starts: inside the block after
    GLM-4.7's `<think>`, in the answer after either template's `</think>`. The answer's calls are then GLM's."""
    from pathlib import Path

    from server.chat_template import render_chat, template_messages
    from server.tool_parsers import parse_tool_calls

    template = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / file).read_text()
    kind = parser_kind("auto", template)
    assert kind == "qwen3"
    extra = {} if thinking is None else {"enable_thinking": thinking}
    prompt = render_chat(template, template_messages([{"role": "user", "content": "Hi"}]), **extra)
    assert starts_in_reasoning(kind, prompt) is (file == "glm_4_7_flash.jinja" and thinking is None)
    for pieces in ([output], list(output), [output[:len(output) // 2], output[len(output) // 2:]]):
        assert run(kind, pieces, prompt=prompt) == Split(reasoning, content)
    calls = parse_tool_calls("glm45", content)[1]
    assert [(c.name, c.arguments) for c in calls] == ([("special_function", '{"arg1": 1}')] if GLM_CALL in content
                                                     else [])


def test_kimi_k2_counts_its_reasoning_tokens_up_to_the_call():
    """Where Kimi's call section marker is one token (its tokenizer's), kimi_k2's count stops at its id, exactly,
    however the ids arrive grouped, as qwen3's stops at `<tool_call>`'s; the kinds without such a marker have none."""
    from server.reasoning import ChoiceReasoning, single_token_call

    encode = {"<think>": [1], "</think>": [2], KIMI_SECTION: [7], "<tool_call>": [3, 4]}.__getitem__
    assert single_token_call(encode, "kimi_k2") == 7 and single_token_call(encode, "deepseek_r1") is None
    assert single_token_call(encode, "qwen3") is None  # (several tokens)
    text, ids = ["<think>", "a", "b", KIMI_SECTION, "<|tool_call_begin|>"], [1, 5, 6, 7, 8]
    for group in (1, 2, 5):
        choice = ChoiceReasoning("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", None, (1, 2), 7)
        for at in range(0, len(ids), group):
            last = at + group >= len(ids)
            choice.feed("".join(text[at:at + group]), ids[at:at + group], last)
        assert choice.tokens.count == 3, group  # <think>, a, b
