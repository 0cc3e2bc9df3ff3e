"""Tool-call parsers on recorded-style outputs of each family.

Oracle: the expected content and calls written by hand from the formats of the models' chat
templates. The streamed result, assembled from the deltas, must equal the non-streamed one for every
chunking: two chunks split at every position, single characters, and seeded random 3-way splits.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from server.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    ToolCallDelta,
    KimiK2ToolParser,
    call_id_maker,
    default_call_id,
    detect_tool_parser,
    kimi_call_id,
    mistral_call_id,
    parse_tool_calls,
)

CALLS_B, CALLS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_B, CALL_E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_MARKERS = (CALLS_B, CALLS_E, CALL_B, CALL_E, SEP)
HERMES_MARKERS = ("<tool_call>", "</tool_call>")
GLM_MARKERS = (*HERMES_MARKERS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
KS_B, KS_E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_B, K_E, K_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_MARKERS = (KS_B, KS_E, K_B, K_E, K_ARGS)
PYTHON_TAG = "<|python_tag|>"
MISTRAL = "[TOOL_CALLS]"


def v3(name: str, args: str) -> str:
    return f"{CALL_B}function{SEP}{name}\n```json\n{args}\n```{CALL_E}"


def v31(name: str, args: str) -> str:
    return f"{CALL_B}{name}{SEP}{args}{CALL_E}"


def xml(name: str, params: list[tuple[str, str]]) -> str:
    """A call as Qwen3-Coder's template writes one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name: str, pairs: list[tuple[str, str]], sep: str = "\n") -> str:
    """A call as GLM-4.5/4.6's template writes one (`sep` ""; as GLM-4.7's writes it)."""
    body = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in pairs)
    return f"<tool_call>{name}{sep}{body}</tool_call>"


def kimi(name: str, index: int, args: str) -> str:
    """A call as Kimi-K2's templates write one (`index`: the call's number in the conversation)."""
    return f"{K_B}functions.{name}:{index}{K_ARGS}{args}{K_E}"


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


WEATHER = '{"location": "Tokyo", "unit": "celsius"}'
PARIS = '{"location": "Paris"}'
NESTED = ('{"query": "天气 <b> & \\"quotes\\" ｜▁", "filters": {"tags": ["a", "b"], "deep": {"x": [1, 2.5, '
          '{"y": null, "z": true}]}}, "code": "```py\\nprint(1 < 2)\\n```", "emoji": "\U0001F600"}')
PRETTY = '{\n  "path": "/tmp/a b.txt",\n  "lines": [\n    1,\n    2\n  ]\n}'

# (parser, generated text, expected content, expected [(name, arguments)])
CASES = [
    # --- DeepSeek-V3 / R1 / V2.5 ---
    ("deepseek_v3", CALLS_B + v3("get_weather", WEATHER) + CALLS_E, "", [("get_weather", WEATHER)]),
    ("deepseek_v3", CALLS_B + v3("get_weather", WEATHER) + "\n" + v3("get_weather", PARIS) + CALLS_E, "",
     [("get_weather", WEATHER), ("get_weather", PARIS)]),
    ("deepseek_v3", "Let me check the weather for you.\n\n" + CALLS_B + v3("get_weather", WEATHER) + CALLS_E,
     "Let me check the weather for you.\n\n", [("get_weather", WEATHER)]),
    ("deepseek_v3", CALLS_B + v3("search", NESTED) + v3("write_file", PRETTY) + CALLS_E, "",
     [("search", NESTED), ("write_file", PRETTY)]),
    ("deepseek_v3", CALLS_B + v3("get_time", "{}") + CALLS_E + "\n\nDone.", "Done.", [("get_time", "{}")]),
    # cut by max_tokens inside the arguments: the call keeps what was written
    ("deepseek_v3", "Sure. " + CALLS_B + v3("get_weather", WEATHER) + "\n" + CALL_B + 'function' + SEP
     + 'search\n```json\n{"q": "hel', "Sure. ", [("get_weather", WEATHER), ("search", '{"q": "hel')]),
    # cut inside the section's end marker, after a whole call: dropped (it was content)
    ("deepseek_v3", CALLS_B + v3("f", "{}") + CALLS_E[:-2], "", [("f", "{}")]),
    # cut inside the closing fence
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + 'f\n```json\n{"a": 1}\n``', "", [("f", '{"a": 1}')]),
    # cut before the name was complete: the markup is content
    ("deepseek_v3", "Sure." + CALLS_B + CALL_B + "function" + SEP + "sea",
     "Sure." + CALLS_B + CALL_B + "function" + SEP + "sea", []),
    # no separator: not a call, shown raw; the next call still parses
    ("deepseek_v3", CALLS_B + CALL_B + "oops" + CALL_E + CALL_B + "function" + SEP + "g\n```json\n{}\n```"
     + CALL_E + CALLS_E, CALLS_B + CALL_B + "oops" + CALL_E, [("g", "{}")]),
    # an empty name: rejected up to where the name ended, whatever the chunking
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + "\n```json\n{}\n```" + CALL_E + v3("g", PARIS) + CALLS_E,
     CALLS_B + CALL_B + "function" + SEP + "\n```json\n{}\n```" + CALL_E, [("g", PARIS)]),
    # the JSON on the fence's line (its first line was taken for the fence's and dropped: "" or a lost brace)
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + 'get_weather\n```json ' + WEATHER + "\n```" + CALL_E + CALLS_E,
     "", [("get_weather", WEATHER)]),
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + "f\n```json" + PRETTY + "\n```" + CALL_E + CALLS_E, "",
     [("f", PRETTY)]),
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + "f\n```" + PARIS + "```" + CALL_E + CALLS_E, "",
     [("f", PARIS)]),
    ("deepseek_v3", CALLS_B + CALL_B + "function" + SEP + "f\n```json\n```" + CALL_E + CALLS_E, "", [("f", "{}")]),
    ("deepseek_v3", "The answer is 42.\nNo tools needed.", "The answer is 42.\nNo tools needed.", []),
    ("deepseek_v3", "If a < b then <｜User｜> is not <｜tool▁callx or <｜tool▁calls▁begi.  Ends with <",
     "If a < b then <｜User｜> is not <｜tool▁callx or <｜tool▁calls▁begi.  Ends with <", []),
    # --- DeepSeek-V3.1 ---
    ("deepseek_v31", CALLS_B + v31("get_weather", WEATHER) + CALLS_E, "", [("get_weather", WEATHER)]),
    ("deepseek_v31", CALLS_B + v31("get_weather", WEATHER) + v31("get_weather", PARIS) + CALLS_E, "",
     [("get_weather", WEATHER), ("get_weather", PARIS)]),
    ("deepseek_v31", "好的，我来查一下。" + CALLS_B + v31("search", NESTED) + CALLS_E,
     "好的，我来查一下。", [("search", NESTED)]),
    ("deepseek_v31", CALLS_B + v31("write_file", PRETTY) + CALLS_E, "", [("write_file", PRETTY)]),
    ("deepseek_v31", CALLS_B + v31("get_weather", WEATHER) + CALL_B + "search" + SEP + '{"q": ["a", ',
     "", [("get_weather", WEATHER), ("search", '{"q": ["a",')]),
    ("deepseek_v31", CALLS_B + CALL_B + "get_time" + SEP + CALL_E + CALLS_E, "", [("get_time", "{}")]),  # was ""
    ("deepseek_v31", CALLS_B + CALL_B + "f" + SEP + "```json " + PARIS + "\n```" + CALL_E + CALLS_E, "", [("f", PARIS)]),
    ("deepseek_v31", "Hmm " + CALLS_B + CALL_B + "get_wea", "Hmm " + CALLS_B + CALL_B + "get_wea", []),
    ("deepseek_v31", "Compare x<y and <｜tool▁sep. Plain.", "Compare x<y and <｜tool▁sep. Plain.", []),
    # --- Hermes / Qwen2.5 ---
    ("hermes", hermes("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("hermes", hermes("get_weather", WEATHER) + "\n" + hermes("get_weather", PARIS), "",
     [("get_weather", WEATHER), ("get_weather", PARIS)]),
    ("hermes", "I'll look that up.\n" + hermes("search", NESTED), "I'll look that up.\n", [("search", NESTED)]),
    ("hermes", hermes("write_file", PRETTY) + "\nThat should do it.", "That should do it.",
     [("write_file", PRETTY)]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),
    # the object's `}` left out: the block's close still ends the call; a good block after it parses
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n' + hermes("g", PARIS),
     "", [("f", '{"a": 1}'), ("g", PARIS)]),
    # a block whose head is not a call's stays content, raw
    ("hermes", '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>', "", [("f", "{}")]),  # read whole
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "f"} x\n</tool_call>',
     '<tool_call>\n{"arguments": {}, "name": "f"} x\n</tool_call>', []),
    # text after the call object: content (the closing tag is markup); other members after the arguments: dropped
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call> after', "trailing\nafter",
     [("f", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}, "id": "x}", "n": {}}\n</tool_call>',
     "", [("f", '{"a": [1, "}"]}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}, I am not sure}</tool_call> Ok',
     ", I am not sure}Ok", [("f", '{"a": 1}')]),
    # the first </tool_call> closes the block wherever it is, as vLLM reads blocks: a stray quote does not take
    # the rest of the reply (a later call included) into the call; a tag inside a string cuts it there
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}, "note": "5" tall"}\n</tool_call>\n'
     "It is sunny.\n" + hermes("g", PARIS), "It is sunny.\n", [("f", '{"city": "Paris"}'), ("g", PARIS)]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"q": "5" tall"}}\n</tool_call>\nIt is sunny.', "It is sunny.",
     [("f", '{"q": "5" tall"}}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>',
     "')\"}}</tool_call>", [("f", '{"code": "print(\'')]),
    # two objects in one block, a block whose close was left out: calls all the same
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>', "",
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n' + hermes("b", PARIS), "", [("a", "{}"), ("b", PARIS)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}} and <tool_call>{"name": "b", "arguments": {}}</tool_call>',
     "and ", [("a", "{}"), ("b", "{}")]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n{"name": 1}\n</tool_call>', '{"name": 1}\n',
     [("a", "{}")]),
    # no function has an empty name; a head past any name's length is read whole
    ("hermes", '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>{"name": "' + "n" * 600 + '", "arguments": {"a": 1}}</tool_call>', "", [("n" * 600, '{"a": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\nNow I wait.', "Now I wait.", [("f", "{}")]),
    # cut before the head was whole: raw content, unless its call object is whole (only the close was cut:
    # vLLM's); cut inside the arguments: the call, its arguments partial (as DeepSeek's, as OpenAI's)
    ("hermes", hermes("f", "{}") + '\n<tool_call>\n{"name": "g", "argum', '<tool_call>\n{"name": "g", "argum',
     [("f", "{}")]),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {"text": "hel', "", [("g", '{"text": "hel')]),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {"text": "hel  \n', "", [("g", '{"text": "hel')]),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {"a",</tool_call>\nDone.', "Done.", [("g", '{"a",')]),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {"text": "hel</tool_call', "", [("g", '{"text": "hel')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "id": "x', "", [("f", '{"a": 1}')]),
    ("hermes", 'Checking.\n<tool_call>\n{"name": "g", "arguments": ' + PARIS + "}\n", "Checking.\n", [("g", PARIS)]),
    # ... or part of the closing tag
    *(("hermes", '<tool_call>\n{"name": "g", "arguments": ' + PARIS + "}\n" + part, "", [("g", PARIS)])
      for part in ("<", "</", "</tool", "</tool_call")),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {}} </x', "</x", [("g", "{}")]),
    ("hermes", '<tool_call>{"name": "g", "arguments": {}} trailing </tool_c', "trailing ", [("g", "{}")]),
    ("hermes", '<tool_call>\n{"name": "g", "arguments": {}} and', "and", [("g", "{}")]),
    ("hermes", "Use <tools> or <tool_calls>, a < b, </tool_call.",
     "Use <tools> or <tool_calls>, a < b, </tool_call.", []),
    ("hermes", "Plain answer with no calls.", "Plain answer with no calls.", []),
    # arguments written as a JSON string holding an object: that object's text, not a string's
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "",
     [("f", '{"city": "Paris"}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "not an object"}\n</tool_call>', "",
     [("f", '"not an object"')]),
    ("llama3_json", '{"name": "f", "parameters": " {\\"a\\": [1]} "}', "", [("f", '{"a": [1]}')]),
    ("hermes", "trailing <tool", "trailing <tool", []),
    # --- Llama 3.1 / 3.2 JSON ---
    ("llama3_json", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "", [("get_weather", WEATHER)]),
    ("llama3_json", PYTHON_TAG + '{"name": "search", "arguments": ' + NESTED + "}", "", [("search", NESTED)]),
    ("llama3_json", '\n {"name": "a", "parameters": {}}; {"name": "b", "parameters": ' + PRETTY + "}", "",
     [("a", "{}"), ("b", PRETTY)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Pa', '{"name": "get_weather", '
     '"parameters": {"location": "Pa', []),
    ("llama3_json", '{"result": 5}', '{"result": 5}', []),
    # text after the calls, text before the tag, an array of calls: calls and content, as vLLM and SGLang
    # read them (all of it was content)
    ("llama3_json", '{"name": "a", "parameters": {}}; then text', "then text", [("a", "{}")]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + WEATHER + "} Let me know!", "Let me know!",
     [("get_weather", WEATHER)]),
    ("llama3_json", "Sure! " + PYTHON_TAG + '{"name": "f", "parameters": ' + PARIS + "}", "Sure! ", [("f", PARIS)]),
    ("llama3_json", '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": ' + PRETTY + "}]", "",
     [("a", "{}"), ("b", PRETTY)]),
    ("llama3_json", "[1, 2, 3] are the numbers", "[1, 2, 3] are the numbers", []),
    ("llama3_json", PYTHON_TAG + "hello " + PYTHON_TAG + "x", PYTHON_TAG + "hello " + PYTHON_TAG + "x", []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": 5}', '{"name": 5}', [("a", "{}")]),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    ("llama3_json", "  Hello <|python", "  Hello <|python", []),
    # --- Mistral: v0.3's JSON array, tokenizer v11's NAME[ARGS]ARGS per call ---
    ("mistral", MISTRAL + ' [{"name": "get_weather", "arguments": ' + WEATHER + "}]", "", [("get_weather", WEATHER)]),
    ("mistral", "Checking. " + MISTRAL + ' [{"name": "a", "arguments": {}}, {"name": "search", "arguments": '
     + NESTED + "}]", "Checking. ", [("a", "{}"), ("search", NESTED)]),
    ("mistral", MISTRAL + "get_weather[ARGS]" + WEATHER, "", [("get_weather", WEATHER)]),
    ("mistral", "Sure, both. " + MISTRAL + "get_weather[ARGS]" + WEATHER + MISTRAL + "write_file[ARGS]" + PRETTY,
     "Sure, both. ", [("get_weather", WEATHER), ("write_file", PRETTY)]),
    ("mistral", MISTRAL + "get_weather[CALL_ID]a1B2c3D4e[ARGS] " + PARIS + "\n", "", [("get_weather", PARIS)]),
    ("mistral", MISTRAL + 'search[ARGS]{"q": "hel', "", [("search", '{"q": "hel')]),  # cut by max_tokens
    ("mistral", MISTRAL + " [not, json]", MISTRAL + " [not, json]", []),
    ("mistral", MISTRAL + "no arguments", MISTRAL + "no arguments", []),
    ("mistral", "Use [TOOL_CALL] or [ARGS] as words [TOOL", "Use [TOOL_CALL] or [ARGS] as words [TOOL", []),
    # prose that names the markers stays content, whatever the chunking (a call was made of it, and a head cut
    # by a second marker read differently streamed)
    ("mistral", "The token " + MISTRAL + " marks calls, e.g. [ARGS] holds arguments.",
     "The token " + MISTRAL + " marks calls, e.g. [ARGS] holds arguments.", []),
    ("mistral", MISTRAL + "x " + MISTRAL + "f[ARGS]{}", MISTRAL + "x ", [("f", "{}")]),
    ("mistral", MISTRAL + "f[ARGS]not json", MISTRAL + "f[ARGS]not json", []),
    # the arguments end where their object closes: text after is content, a marker inside a string is text
    ("mistral", MISTRAL + 'f[ARGS]{"a": 1}\n\nDone.', "Done.", [("f", '{"a": 1}')]),
    ("mistral", MISTRAL + 'f[ARGS]{"q": "a [TOOL_CALLS]b[ARGS]{c}"}', "", [("f", '{"q": "a [TOOL_CALLS]b[ARGS]{c}"}')]),
    ("mistral", MISTRAL + "get_time[ARGS]", "", [("get_time", "{}")]),  # no arguments: {}, as OpenAI's
    # --- Qwen3-Coder / Qwen3.5 / Nemotron 3 (XML-like calls; these without tools: values JSON where they parse as
    # a non-string JSON value, else text) ---
    ("qwen3_coder", xml("get_weather", [("location", "Tokyo"), ("unit", "celsius")]), "", [("get_weather", WEATHER)]),
    ("qwen3_coder", "Let me check.\n\n" + xml("get_weather", [("location", "Paris")]) + "\n"
     + xml("forecast", [("days", "3"), ("metric", "true"), ("ratio", "2.5"), ("opts", '{"a": [1, null]}')]),
     "Let me check.\n\n", [("get_weather", PARIS), ("forecast", '{"days": 3, "metric": true, "ratio": 2.5, '
                                                               '"opts": {"a": [1, null]}}')]),
    # a value spans lines and holds < and > and quotes: text, its one newline at each end dropped
    ("qwen3_coder", xml("write_file", [("path", "/tmp/a b.txt"), ("content", 'def f(x):\n    return x < 2 > "y"\n')]),
     "", [("write_file", '{"path": "/tmp/a b.txt", "content": "def f(x):\\n    return x < 2 > \\"y\\"\\n"}')]),
    # no parameters; two functions in one block; text after the block
    ("qwen3_coder", "<tool_call>\n<function=list_files>\n</function>\n<function=get_time>\n</function>\n</tool_call>\n"
     "Done.", "Done.", [("list_files", "{}"), ("get_time", "{}")]),
    # closes left out: a value ends at the next parameter, and the function at the block's close
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\n7\n</tool_call>", "",
     [("f", '{"a": "x", "b": 7}')]),
    # cut off (max_tokens, a stop string) in a value: the call keeps it, its object left open as other parsers
    # leave a cut call's (the reply is not reported as having made it); cut in a key or a tag: the members written
    ("qwen3_coder", "Sure. " + "<tool_call>\n<function=search>\n<parameter=q>\nhel", "Sure. ",
     [("search", '{"q": "hel"')]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nhello\n</param", "", [("search", '{"q": "hello"')]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nhi\n</parameter>\n<parameter=li", "",
     [("search", '{"q": "hi"')]),
    ("qwen3_coder", "Hi.\n<tool_call>\n<function=f>\n<parameter=s>\na\n</parameter>\n<para", "Hi.\n",
     [("f", '{"s": "a"')]),
    ("qwen3_coder", "Hi.\n<tool_call>\n<function=f>\n</function>\n<functi", "Hi.\n", [("f", "{}")]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=s>\na\n</parameter>\n</functio", "", [("f", '{"s": "a"')]),
    # the next function's name cut off: its markup is content, whole
    ("qwen3_coder", "Hi.\n<tool_call>\n<function=f>\n</function>\n<function=g", "Hi.\n\n<function=g",
     [("f", "{}")]),
    # text inside a function outside its parameters, and a parameter with no name, are skipped; a parameter
    # given twice keeps its first value
    ("qwen3_coder", "<tool_call>\n<function=f>\nhello\n<parameter=i>\n2\n</parameter>\n<parameter= >\nx\n"
     "</parameter>\n<parameter=i>\n3\n</parameter>\n</function>\n</tool_call>", "", [("f", '{"i": 2}')]),
    # no newlines at all, spaces between tags
    ("qwen3_coder", "<tool_call><function=f><parameter=a>1</parameter> <parameter=b>x y</parameter></function>"
     "</tool_call>", "", [("f", '{"a": 1, "b": "x y"}')]),
    # NaN, Infinity and numbers past a double's range are no JSON: the text stays text
    ("qwen3_coder", xml("f", [("a", "[NaN]"), ("o", '{"x": Infinity}'), ("n", "9" * 400)]), "",
     [("f", '{"a": "[NaN]", "o": "{\\"x\\": Infinity}", "n": "' + "9" * 400 + '"}')]),
    # cut before the name was whole, or a block with no function: content as written
    ("qwen3_coder", "Sure <tool_call>\n<function=get_wea", "Sure <tool_call>\n<function=get_wea", []),
    ("qwen3_coder", "<tool_call>\nhello\n</tool_call> ok", "<tool_call>\nhello\n</tool_call> ok", []),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>", "<tool_call>\n<function=>\n</function>\n"
     "</tool_call>", []),
    # prose naming the tags outside a block stays content
    ("qwen3_coder", "Write <function=x> and <parameter=y> in XML.", "Write <function=x> and <parameter=y> in XML.", []),
    # --- GLM-4.5 / 4.6 / 4.7 (these without tools: values JSON where they parse as a non-string JSON value, else
    # text; the name, then <arg_key>/<arg_value> pairs; GLM-4.7 writes them with no newlines) ---
    ("glm45", glm("get_weather", [("location", "Tokyo"), ("unit", "celsius")]), "", [("get_weather", WEATHER)]),
    ("glm45", "Let me check.\n" + glm("get_weather", [("location", "Paris")], sep="")
     + glm("forecast", [("days", "3"), ("metric", "true"), ("ratio", "2.5"), ("opts", '{"a": [1, null]}')], sep="")
     + "\nDone.", "Let me check.\nDone.",
     [("get_weather", PARIS), ("forecast", '{"days": 3, "metric": true, "ratio": 2.5, "opts": {"a": [1, null]}}')]),
    # a value is exactly the text between its tags: newlines at its ends, <, > and quotes kept
    ("glm45", glm("write_file", [("path", "/tmp/a b.txt"), ("content", '\ndef f(x):\n    return x < 2 > "y"\n')]),
     "", [("write_file", '{"path": "/tmp/a b.txt", "content": "\\ndef f(x):\\n    return x < 2 > \\"y\\"\\n"}')]),
    # calls without arguments, in both forms; layout between the blocks is no content
    ("glm45", "<tool_call>list_files</tool_call>\n<tool_call>get_time\n</tool_call>\n", "",
     [("list_files", "{}"), ("get_time", "{}")]),
    # a value ends at its close, whatever it holds (vLLM's reading: a coding agent's text about the markup); a
    # close left out ends it at the block's close
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>Use <arg_key>K</arg_key> tags</arg_value>\n"
     "<arg_key>b</arg_key><arg_value>7</tool_call>", "", [("f", '{"a": "Use <arg_key>K</arg_key> tags", "b": 7}')]),
    # cut off (max_tokens, a stop string) in a value, a close tag, a key, between a key and its value, or in the
    # block's close: the members written, the one being written too, the object left open
    ("glm45", "Sure. <tool_call>search\n<arg_key>q</arg_key>\n<arg_value>hel", "Sure. ", [("search", '{"q": "hel"')]),
    ("glm45", "<tool_call>search<arg_key>q</arg_key><arg_value>hello</arg_val", "", [("search", '{"q": "hello"')]),
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>hi</arg_value>\n<arg_key>li", "",
     [("search", '{"q": "hi"')]),
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>hi</arg_value>\n<arg_key>n</arg_key>\n<arg_va",
     "", [("search", '{"q": "hi"')]),
    ("glm45", "Hi.\n<tool_call>f<arg_key>s</arg_key><arg_value>a</arg_value></tool_ca", "Hi.\n", [("f", '{"s": "a"')]),
    # text between the pairs, a key with no value and an empty key are skipped; a key given twice keeps its first
    ("glm45", "<tool_call>f\nhello\n<arg_key>i</arg_key>\n<arg_value>2</arg_value>\n<arg_key> </arg_key><arg_value>x"
     "</arg_value><arg_key>j</arg_key>oops<arg_key>i</arg_key><arg_value>3</arg_value></tool_call>", "",
     [("f", '{"i": 2}')]),
    # NaN, Infinity and numbers past a double's range are no JSON: the text stays text
    ("glm45", glm("f", [("a", "[NaN]"), ("o", '{"x": Infinity}'), ("n", "9" * 400)], sep=""), "",
     [("f", '{"a": "[NaN]", "o": "{\\"x\\": Infinity}", "n": "' + "9" * 400 + '"}')]),
    # a name cut off before it was whole, empty, with spaces or another tag after it: content as written
    ("glm45", "Sure <tool_call>get_wea", "Sure <tool_call>get_wea", []),
    ("glm45", "<tool_call>get_time</tool_ca", "<tool_call>get_time</tool_ca", []),
    ("glm45", "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> ok",
     "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> ok", []),
    ("glm45", "Wrap calls in <tool_call> tags, keys in <arg_key>.",
     "Wrap calls in <tool_call> tags, keys in <arg_key>.", []),
    ("glm45", "<tool_call>f<b>x</b></tool_call>", "<tool_call>f<b>x</b></tool_call>", []),
    # --- Kimi-K2: the expected calls are (name, arguments, id); the id is the model's where well-formed ---
    ("kimi_k2", KS_B + kimi("get_weather", 0, WEATHER) + KS_E, "", [("get_weather", WEATHER, "functions.get_weather:0")]),
    ("kimi_k2", "Let me check both.\n" + KS_B + kimi("get_weather", 3, WEATHER) + kimi("now", 4, "{}") + KS_E,
     "Let me check both.\n", [("get_weather", WEATHER, "functions.get_weather:3"), ("now", "{}", "functions.now:4")]),
    ("kimi_k2", KS_B + kimi("search", 0, NESTED) + kimi("write_file", 1, PRETTY) + KS_E + "\n\nDone.", "Done.",
     [("search", NESTED, "functions.search:0"), ("write_file", PRETTY, "functions.write_file:1")]),
    # newlines and spaces around the markers (the templates write none; models at times do)
    ("kimi_k2", "好的。\n" + KS_B + "\n" + K_B + " functions.get_weather:0 " + K_ARGS + "\n" + PARIS + "\n" + K_E
     + "\n" + K_B + "functions.f:1" + K_ARGS + " {} " + K_E + "\n" + KS_E, "好的。\n",
     [("get_weather", PARIS, "functions.get_weather:0"), ("f", "{}", "functions.f:1")]),
    # a dotted (MCP-style) name, a name holding `:`: the name is all between `functions.` and the last `:`
    ("kimi_k2", KS_B + kimi("mcp.fs.read", 0, PARIS) + kimi("a:b", 1, "{}") + KS_E, "",
     [("mcp.fs.read", PARIS, "functions.mcp.fs.read:0"), ("a:b", "{}", "functions.a:b:1")]),
    # no section marker: a bare call begin opens a call (llama.cpp's reading)
    ("kimi_k2", "Ok " + kimi("f", 0, PARIS), "Ok ", [("f", PARIS, "functions.f:0")]),
    # no arguments at all: "{}"
    ("kimi_k2", KS_B + K_B + "functions.now:0" + K_ARGS + K_E + KS_E, "", [("now", "{}", "functions.now:0")]),
    # ids not in the templates' form still name the call, which gets a new id (here `_ids()`'s; by default the
    # one the template writes: test_kimi_k2_ids); so does a repeated id
    ("kimi_k2", KS_B + K_B + "get_weather:0" + K_ARGS + PARIS + K_E + K_B + "functions.now" + K_ARGS + "{}" + K_E
     + K_B + "functions.f:x" + K_ARGS + "{}" + K_E + KS_E, "",
     [("get_weather", PARIS, "call_0"), ("now", "{}", "call_1"), ("f:x", "{}", "call_2")]),
    ("kimi_k2", KS_B + kimi("f", 1, "{}") + kimi("f", 1, PARIS) + kimi("f", 0, "{}") + KS_E, "",
     [("f", "{}", "functions.f:1"), ("f", PARIS, "call_0"), ("f", "{}", "functions.f:0")]),
    # malformed JSON: passed on as written (arguments are the model's text; the client decides)
    ("kimi_k2", KS_B + kimi("f", 0, '{"a": tall"}}') + KS_E, "", [("f", '{"a": tall"}}', "functions.f:0")]),
    # cut by max_tokens (or a stop string) inside the arguments: the call keeps what was written
    ("kimi_k2", "Sure. " + KS_B + kimi("get_weather", 0, WEATHER) + K_B + 'functions.search:1' + K_ARGS + '{"q": "hel',
     "Sure. ", [("get_weather", WEATHER, "functions.get_weather:0"), ("search", '{"q": "hel', "functions.search:1")]),
    ("kimi_k2", KS_B + K_B + "functions.f:0" + K_ARGS + '{"a": 1}' + K_E[:-3], "", [("f", '{"a": 1}', "functions.f:0")]),
    # a call's end marker left out: it ends where the next call begins (llama.cpp's reading); its arguments took
    # the next call in
    ("kimi_k2", KS_B + K_B + "functions.a:0" + K_ARGS + '{"x": 1}' + kimi("b", 1, '{"y": 2}') + KS_E, "",
     [("a", '{"x": 1}', "functions.a:0"), ("b", '{"y": 2}', "functions.b:1")]),
    # cut inside a marker after a whole call (where the markers are several tokens): dropped, not content
    ("kimi_k2", KS_B + kimi("f", 0, "{}") + KS_E[:-3], "", [("f", "{}", "functions.f:0")]),
    ("kimi_k2", KS_B + kimi("f", 0, "{}") + "\n" + K_B[:9], "", [("f", "{}", "functions.f:0")]),
    # cut before the header was whole: the markup is content
    ("kimi_k2", "Sure." + KS_B + K_B + "functions.sea", "Sure." + KS_B + K_B + "functions.sea", []),
    ("kimi_k2", "Sure." + KS_B + K_B + "functions.search:0" + K_ARGS[:-4],
     "Sure." + KS_B + K_B + "functions.search:0" + K_ARGS[:-4], []),
    # an empty name, whitespace in it, or no argument marker: no call, shown raw; the next call still parses
    ("kimi_k2", KS_B + K_B + "functions.:0" + K_ARGS + "{}" + K_E + kimi("g", 1, PARIS) + KS_E,
     KS_B + K_B + "functions.:0" + K_ARGS + "{}" + K_E, [("g", PARIS, "functions.g:1")]),
    ("kimi_k2", KS_B + K_B + "functions.get weather:0" + K_ARGS + "{}" + K_E + KS_B + kimi("g", 1, "{}") + KS_E,
     KS_B + K_B + "functions.get weather:0" + K_ARGS + "{}" + K_E, [("g", "{}", "functions.g:1")]),
    ("kimi_k2", KS_B + K_B + "oops" + K_E + kimi("g", 0, "{}") + KS_E, KS_B + K_B + "oops" + K_E,
     [("g", "{}", "functions.g:0")]),
    # another model's markers, or text that only begins like Kimi's, are content
    ("kimi_k2", "Plain <|tool_calls_sec or <|tool_call_b, " + CALLS_B + "and <|im_end",
     "Plain <|tool_calls_sec or <|tool_call_b, " + CALLS_B + "and <|im_end", []),
]
CASE_IDS = [f"{i}-{case[0]}" for i, case in enumerate(CASES)]


def _markers(parser: str) -> tuple[str, ...]:
    return {"hermes": HERMES_MARKERS, "qwen3_coder": HERMES_MARKERS, "glm45": GLM_MARKERS,
            "llama3_json": (PYTHON_TAG,), "kimi_k2": KIMI_MARKERS,
            "mistral": (MISTRAL,)}.get(parser, DEEPSEEK_MARKERS)


def _start_markers(parser: str) -> tuple[str, ...]:
    """The markers that open a call, whose first characters content must never end on mid-stream."""
    return {"hermes": HERMES_MARKERS[:1], "qwen3_coder": HERMES_MARKERS[:1], "glm45": HERMES_MARKERS[:1],
            "llama3_json": (), "kimi_k2": (KS_B, K_B),
            "mistral": (MISTRAL,)}.get(parser, (CALLS_B, CALL_B))


def _ids():
    counter = itertools.count()
    return lambda *_: f"call_{next(counter)}"


def _expected(calls: list[tuple]) -> tuple[list[tuple[str, str]], list[str]]:
    """A case's (name, arguments) pairs and ids: its own where it gives them (Kimi-K2's), else `_ids()`'s."""
    return [(c[0], c[1]) for c in calls], [c[2] if len(c) > 2 else f"call_{i}" for i, c in enumerate(calls)]


def _stream(parser: str, chunks: list[str], ids: list[str] | None = None) -> tuple[str, list[tuple[str, str]]]:
    """Feeds `chunks`, checks the delta protocol (a call's first delta has id `ids[index]`, default
    `call_{index}`) and content pieces, returns the assembled result."""
    p = TOOL_PARSERS[parser](_ids())
    pieces: list[tuple[str, bool]] = []
    deltas: list[ToolCallDelta] = []
    for chunk in chunks:
        content, ds = p.feed(chunk)
        pieces.append((content, False))
        deltas += ds
    content, ds = p.finish()
    pieces.append((content, True))
    deltas += ds

    calls: list[dict] = []
    for d in deltas:
        if d.index == len(calls):  # a call's first delta: id and name, no arguments yet
            assert d.id == (ids[d.index] if ids else f"call_{d.index}") and d.name and d.arguments == ""
            calls.append({"name": d.name, "arguments": ""})
        else:
            assert d.index == len(calls) - 1, "deltas of an earlier call after a later one opened"
            assert d.id is None and d.name is None and d.arguments
            calls[d.index]["arguments"] += d.arguments
    assembled = [(c["name"], c["arguments"]) for c in calls]
    assert assembled == [(c.name, c.arguments) for c in p.tool_calls]
    assert [d.id for d in deltas if d.id is not None] == [c.id for c in p.tool_calls]
    full = "".join(text for text, _ in pieces)

    markers = _markers(parser)
    if not any(m in full for m in markers):  # markup that made no call is raw content by design
        for text, last in pieces:
            assert not any(m in text for m in markers)
            if not last:  # the start of a marker is held back, never sent dangling
                starts = _start_markers(parser)
                assert not any(m.startswith(text[-k:]) for m in starts for k in range(1, len(text) + 1))
    return full, assembled


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=CASE_IDS)
def test_non_streamed(parser, text, content, calls):
    calls, ids = _expected(calls)
    got_content, got_calls = parse_tool_calls(parser, text, new_id=_ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == ids
    for _, args in calls:
        cut = parser in ("qwen3_coder", "glm45") and not args.endswith("}")  # (their cut calls' objects are left open)
        if not args.endswith(("hel", '"a",', 'tall"}}', "print('")) and not cut:  # the cut-off and malformed ones
            json.loads(args)


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=CASE_IDS)
def test_streamed_matches_non_streamed(parser, text, content, calls):
    calls, ids = _expected(calls)
    expected = (content, calls)
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]], ids) == expected, f"split at {i}"
    assert _stream(parser, list(text), ids) == expected
    rng = random.Random(1234)
    for _ in range(30):
        a, b = sorted(rng.sample(range(len(text) + 1), 2))
        assert _stream(parser, [text[:a], text[a:b], text[b:]], ids) == expected, (a, b)


def test_deepseek_streams_arguments_incrementally():
    """The header goes out as soon as the name is complete; arguments follow as written, the closing
    fence held back only while it might be one."""
    p = DeepSeekV3ToolParser(_ids())
    assert p.feed("Hi" + CALLS_B + CALL_B + "function" + SEP + "get_") == ("Hi", [])
    assert p.feed("weather\n```json\n") == ("", [ToolCallDelta(0, "call_0", "get_weather")])
    assert p.feed('{"location": ') == ("", [ToolCallDelta(0, arguments='{"location":')])
    assert p.feed('"Tokyo"}\n`') == ("", [ToolCallDelta(0, arguments=' "Tokyo"}')])
    assert p.feed("``" + CALL_E[:3]) == ("", [])
    assert p.feed(CALL_E[3:] + CALLS_E) == ("", [])
    assert p.finish() == ("", [])
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", '{"location": "Tokyo"}')]


def test_hermes_streams_arguments_incrementally():
    """The call opens once its head is whole; arguments follow as written, trailing whitespace and a tail
    that may begin `</tool_call>` held back (a brace in a string is text). A block with another head is
    sent whole when it closes."""
    p = TOOL_PARSERS["hermes"](_ids())
    assert p.feed("Ok <tool") == ("Ok ", [])
    assert p.feed('_call>\n{"name": "f", "argu') == ("", [])
    assert p.feed('ments": {') == ("", [ToolCallDelta(0, "call_0", "f"), ToolCallDelta(0, arguments="{")])
    assert p.feed('"x": 1, ') == ("", [ToolCallDelta(0, arguments='"x": 1,')])
    assert p.feed('"s": "a}</to') == ("", [ToolCallDelta(0, arguments=' "s": "a}')])
    assert p.feed('o"}') == ("", [ToolCallDelta(0, arguments='</too"}')])
    assert p.feed("}\n</tool_") == ("", [])
    assert p.feed("call> Done") == ("Done", [])
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("f", '{"x": 1, "s": "a}</too"}')]
    p = TOOL_PARSERS["hermes"](_ids())
    assert p.feed('<tool_call>{"arguments": {"x": 1}, "name": "f"}\n</tool_') == ("", [])
    assert p.feed("call>") == ("", [ToolCallDelta(0, "call_0", "f"), ToolCallDelta(0, arguments='{"x": 1}')])


def test_registry_and_ids():
    assert TOOL_PARSERS["deepseek_v25"] is TOOL_PARSERS["deepseek_v3"]
    assert TOOL_PARSERS["glm47"] is TOOL_PARSERS["glm45"]  # (vLLM's two names; one reading takes both forms)
    assert set(TOOL_PARSERS) == {"deepseek_v3", "deepseek_v31", "deepseek_v25", "hermes", "llama3_json", "mistral",
                                 "qwen3_coder", "glm45", "glm47", "kimi_k2"}
    ids = {default_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    ids = {mistral_call_id() for _ in range(100)}  # what Mistral's templates accept back
    assert len(ids) == 100 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert call_id_maker(MINISTRAL3) is mistral_call_id and call_id_maker(CHATML_TEMPLATE) is default_call_id


# Snippets of the real templates' tool-call rendering.
V3_TEMPLATE = ("{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] "
               "+ '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
               "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}")
V31_TEMPLATE = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
                "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}")
QWEN_TEMPLATE = ("{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
                 "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
                 "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}")
LLAMA31_TEMPLATE = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '<|python_tag|>' + "
                    "tool_call.name + '.call(' }}")
LLAMA32_TEMPLATE = ("{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}{{- 'Respond in the format "
                    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}")
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}"
QWEN3_CODER_TEMPLATE = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for k, v in "
                        "tool_call.arguments|items %}{{- '<parameter=' + k + '>\\n' }}")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
MINISTRAL3 = (FIXTURES / "ministral3.jinja").read_text()
KIMI_TEMPLATE = (FIXTURES / "kimi_k2.jinja").read_text()


@pytest.mark.parametrize("template, expected", [
    (V3_TEMPLATE, "deepseek_v3"),
    (V31_TEMPLATE, "deepseek_v31"),
    (QWEN_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    (LLAMA32_TEMPLATE, "llama3_json"),
    (CHATML_TEMPLATE, None),
    # <tool_call> tags around calls the hermes parser cannot read: GLM's <arg_key> pairs and Qwen3-Coder's XML
    # (each its own parser); <arg_key> alone, without GLM's <arg_value>, is no markup a parser knows
    ((FIXTURES / "glm_4_6.jinja").read_text(), "glm45"),
    ((FIXTURES / "glm_4_7_flash.jinja").read_text(), "glm45"),
    ("{{ '<tool_call>' + name }}{{ '<arg_key>' + k + '</arg_key>' }}", None),
    (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
    ((FIXTURES / "qwen3_coder.jinja").read_text(), "qwen3_coder"),
    ((FIXTURES / "qwen2_5.jinja").read_text(), "hermes"),
    ((FIXTURES / "ministral3.jinja").read_text(), "mistral"),
    ((FIXTURES / "kimi_k2.jinja").read_text(), "kimi_k2"),
    ("{{ '<|tool_calls_section_begin|>' }}{{ '<|tool_call_begin|>' + formatted_id }}", "kimi_k2"),
    ("{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}", "mistral"),  # v0.3's
    ("", None),
    (None, None),
])
def test_detect_tool_parser(template, expected):
    assert detect_tool_parser(template) == expected


def _required_calls(pieces: list[str]) -> list[tuple[str, str]]:
    """(name, arguments) of tool_choice "required"'s calls assembled from the deltas of `pieces`."""
    from server.tools import RequiredToolCalls

    parser, calls = RequiredToolCalls(), {}
    for piece in pieces:
        content, deltas = parser.feed(piece)
        assert content == ""  # nothing of the array reaches the content
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (d.name or name, args + d.arguments)
    assert [(c.name, c.arguments) for c in parser.calls] == [calls[i] for i in sorted(calls)]
    return [calls[i] for i in sorted(calls)]


def test_required_calls_for_every_chunking_and_cut():
    """tool_choice "required" (the grammar's JSON array of {"name", "parameters"}): the same calls however
    the text is split; cut anywhere, the calls whose names were written, the last one's arguments partial
    (a cut after a name and before its arguments: a call with empty arguments, not nothing)."""
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "q": "a\\"}b"}}, \n {"name":"t","parameters":{}}]'
    whole = [("get_weather", '{"city": "Paris", "q": "a\\"}b"}'), ("t", "{}")]
    assert _required_calls([text]) == whole
    rng = random.Random(5)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), 3))
        assert _required_calls([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == whole
    assert _required_calls(list(text)) == whole
    name_end = text.index('"get_weather"') + len('"get_weather"')
    for cut in range(len(text)):
        got = _required_calls([text[:cut]])
        if cut < name_end:
            assert got == [], (cut, got)
        elif cut < text.index("{", name_end):
            assert got == [("get_weather", "")], (cut, got)
        else:
            assert got[0][0] == "get_weather" and whole[0][1].startswith(got[0][1]), (cut, got)


def test_a_named_call_begins_with_its_first_character():
    """tool_choice naming a function: a reply cut off before it wrote anything (max_tokens spent on its
    reasoning) has no call, as "required"'s has none; once it writes, the call streams as written."""
    from server.tools import MergedDeltas, NamedToolCall, RequiredToolCalls

    for parser in (MergedDeltas(NamedToolCall("f")), RequiredToolCalls()):
        assert parser.feed("") == ("", []) and parser.finish() == ("", []) and parser.tool_calls == []
    named = MergedDeltas(NamedToolCall("f"))
    _, deltas = named.feed('{"a": ')
    named.feed("1}")
    assert [(d.name, d.arguments) for d in deltas] == [("f", '{"a": ')] and named.finish() == ("", [])
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("f", '{"a": 1}')]


def test_kimi_k2_opens_a_call_at_its_header_and_streams_its_arguments():
    """The call opens (id and name) once `<|tool_call_argument_begin|>` ends its header; arguments follow as
    written, a tail that may begin `<|tool_call_end|>` held back; the id is the model's."""
    p = TOOL_PARSERS["kimi_k2"](_ids())
    assert p.feed("Hi" + KS_B[:7]) == ("Hi", [])
    assert p.feed(KS_B[7:] + K_B + "functions.get_") == ("", [])
    assert p.feed("weather:12" + K_ARGS[:5]) == ("", [])
    assert p.feed(K_ARGS[5:]) == ("", [ToolCallDelta(0, "functions.get_weather:12", "get_weather")])
    assert p.feed('{"city": ') == ("", [ToolCallDelta(0, arguments='{"city":')])
    assert p.feed('"Paris"}' + K_E[:4]) == ("", [ToolCallDelta(0, arguments=' "Paris"}')])
    assert p.feed(K_E[4:] + K_B + "functions.now:13" + K_ARGS) == ("", [ToolCallDelta(1, "functions.now:13", "now")])
    assert p.feed("{}" + K_E + KS_E + " Done") == ("Done", [ToolCallDelta(1, arguments="{}")])
    assert p.finish() == ("", [])
    assert [(c.id, c.name, c.arguments) for c in p.tool_calls] == [
        ("functions.get_weather:12", "get_weather", '{"city": "Paris"}'), ("functions.now:13", "now", "{}")]


def test_kimi_k2_ids():
    """By default (and where the chat template writes Kimi's calls) a call whose header is not in the templates'
    form, or repeats an id, gets the id the template writes for it, `functions.NAME:I` (I its place in the
    output), unless that one is taken too; a forced call's id (tool_choice named or "required") has the same form."""
    from server.tools import MergedDeltas, NamedToolCall, RequiredToolCalls

    text = (KS_B + K_B + "get_weather:0" + K_ARGS + PARIS + K_E + kimi("f", 1, "{}") + kimi("f", 1, "{}")
            + kimi("g", 4, "{}") + kimi("g", 4, "{}") + KS_E)
    for p in (KimiK2ToolParser(), KimiK2ToolParser(call_id_maker(KIMI_TEMPLATE))):
        p.feed(text)
        p.finish()
        ids = [c.id for c in p.tool_calls]
        assert ids[:4] == ["functions.get_weather:0", "functions.f:1", "functions.f:2", "functions.g:4"], ids
        assert re.fullmatch(r"call_[0-9a-f]{24}", ids[4]), ids  # (its place's id, functions.g:4, is taken)
    assert call_id_maker(KIMI_TEMPLATE)("a.b", 2) == kimi_call_id("a.b", 2) == "functions.a.b:2"
    named = MergedDeltas(NamedToolCall("get_weather", call_id_maker(KIMI_TEMPLATE)))
    named.feed('{"city": "Paris"}')
    named.finish()
    assert [c.id for c in named.tool_calls] == ["functions.get_weather:0"]
    required = RequiredToolCalls(call_id_maker(KIMI_TEMPLATE))
    required.feed('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]')
    required.finish()
    assert [c.id for c in required.calls] == ["functions.a:0", "functions.b:1"]
    # the conversation's calls are counted, as vLLM counts the history's (3 earlier: these are the 4th and 5th);
    # a forced call reused an id the history had
    later = RequiredToolCalls(call_id_maker(KIMI_TEMPLATE, earlier_calls=3))
    later.feed('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]')
    later.finish()
    assert [c.id for c in later.calls] == ["functions.a:3", "functions.b:4"]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_history_written_in_a_parsers_markup_reads_back_as_its_calls(name):
    """A past assistant turn's calls, written for a template that does not render them, are in the markup of
    the parser in force (`ToolParser.written`): a model that copies them is read back, the same calls and the
    same text. They were always Hermes blocks, which `--tool-call-parser deepseek_v3` read as plain text (a
    helper found it)."""
    rng = random.Random()
    cities = ["Paris", "Lyon", "Zürich", 'O"Brien']
    calls = [(rng.choice(["get_weather", "get_time"]), {"city": rng.choice(cities), "days": rng.randrange(9)})
             for _ in range(rng.randint(1, 3))]
    for text in ("", "Let me check."):
        written = TOOL_PARSERS[name].written(text, calls)
        content, got = parse_tool_calls(name, written, new_id=_ids())
        assert content.strip() == text, (name, written)
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, (name, written)


def test_strict_calls_are_not_held_where_the_markup_is_a_special_token():
    """A grammar never lets a special token through: where the markup's tags are special tokens, a grammar
    holding strict calls would leave the model no way to call at all, so it is not applied."""
    import types

    from server.metrics import Metrics
    from server.protocol import ChatCompletionRequest
    from server.serving import request_params
    from server.state import ServerState
    from server.tools import plan_tools

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}]})
    tools = plan_tools(body, None)
    assert tools.structured is not None and tools.markup == HERMES_MARKERS
    for special, held in ((frozenset(), True), (frozenset({7}), False)):
        tok = types.SimpleNamespace(special_ids=special, chat_template=None,
                                    tokenizer=types.SimpleNamespace(token_to_id=lambda t: 7 if t == "<tool_call>" else None))
        state = ServerState(model_name="m", metrics=Metrics("m"), tokenizer=tok, vocab_size=100, context_length=64)
        params = request_params(state, body, [([1, 2], "x")], tools)
        assert (params.structured == tools.structured) is held


QWEN3_CODER_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"type": ["integer", "null"]},
    "u": {"description": "untyped"}, "any": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "choice": {"enum": ["1", "2"]}, "mixed": {"type": ["integer", "string"]}}}}}


def test_qwen3_coder_values_take_their_schema_types():
    """Each parameter's text is read as its schema's type, as vLLM's qwen3_coder parser reads it (a request's
    tools reach the parser through `plan_tools`): a string stays text ("123" too), integers and numbers parse
    (an integral number an int), booleans in any case, objects and arrays as JSON or Python literals, null is
    None; an untyped or undeclared parameter is JSON where it parses as a non-string value. A text that does not
    parse as its type stays the text (vLLM drops the whole call)."""
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [QWEN3_CODER_TOOL]})
    plan = plan_tools(body, (FIXTURES / "qwen3_coder.jinja").read_text())
    assert plan.markup == HERMES_MARKERS

    def args(params: list[tuple[str, str]]) -> dict:
        parser = plan.new_parser()
        parser.feed(xml("f", params))
        parser.finish()
        (call,) = parser.tool_calls
        return json.loads(call.arguments)

    assert args([("s", "123"), ("i", "42"), ("n", "5.0"), ("b", "True"), ("o", "{'k': True, 'v': None}"),
                 ("a", '[1, "x"]'), ("maybe", "null"), ("u", "7"), ("extra", "[1]"), ("word", "yes")]) == {
        "s": "123", "i": 42, "n": 5, "b": True, "o": {"k": True, "v": None}, "a": [1, "x"], "maybe": None, "u": 7,
        "extra": [1], "word": "yes"}
    assert args([("i", "forty"), ("n", "1e999"), ("b", "yes"), ("o", "{not json"), ("maybe", "2")]) == {
        "i": "forty", "n": "1e999", "b": "yes", "o": "{not json", "maybe": 2}
    # a schema of strings alone (anyOf, an enum of strings) keeps the text; several types take the first that reads
    assert args([("any", "123"), ("choice", "1"), ("mixed", "12"), ("n", "007"), ("i", "+5")]) == {
        "any": "123", "choice": "1", "mixed": 12, "n": 7, "i": 5}
    assert args([("mixed", "twelve"), ("n", ".5"), ("i", "١٢٣")]) == {"mixed": "twelve", "n": 0.5, "i": "١٢٣"}
    # what would be no JSON, or fails to read, stays the text (a 500 before: OverflowError, TypeError)
    huge = "9" * 400
    assert args([("n", huge), ("i", huge), ("a", "[b'x']"), ("o", "{'c': 1j}"), ("a2", "[NaN]"), ("i2", "1" * 5000)]) \
        == {"n": huge, "i": huge, "a": "[b'x']", "o": "{'c': 1j}", "a2": "[NaN]", "i2": "1" * 5000}
    # the template's newline off each end, no more: a value's own spaces and newlines are kept
    assert args([("s", "  two spaces\n\n")]) == {"s": "  two spaces\n\n"}


def test_glm_call_opens_at_its_name_and_streams_a_member_at_a_time():
    """A GLM call opens once its name is whole (a newline, `<arg_key>` or `</tool_call>` after it); each member
    goes out once its value closes (its type is known only then), the object's close with `</tool_call>`."""
    p = TOOL_PARSERS["glm45"](_ids())
    assert p.feed("Ok <tool") == ("Ok ", [])
    assert p.feed("_call>get_wea") == ("", [])
    assert p.feed("ther<arg") == ("", [])  # (`<arg` may still be another tag: no call yet)
    assert p.feed("_key>ci") == ("", [ToolCallDelta(0, "call_0", "get_weather")])
    assert p.feed("ty</arg_key><arg_value>Par") == ("", [])
    assert p.feed("is</arg_value><arg_key>days</arg_key><arg_value>3") == \
        ("", [ToolCallDelta(0, arguments='{"city": "Paris"')])
    assert p.feed("</arg_value></tool_") == ("", [ToolCallDelta(0, arguments=', "days": 3')])
    assert p.feed("call> Done") == ("Done", [ToolCallDelta(0, arguments="}")])
    assert p.feed("<tool_call>get_time\n") == ("", [ToolCallDelta(1, "call_1", "get_time")])  # GLM-4.6's newline
    assert p.feed("</tool_call>") == ("", [ToolCallDelta(1, arguments="{}")])
    assert p.finish() == ("", [])
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", '{"city": "Paris", "days": 3}'),
                                                            ("get_time", "{}")]


@pytest.mark.parametrize("template", ["glm_4_6.jinja", "glm_4_7_flash.jinja"])
def test_glm_values_take_their_schema_types(template):
    """GLM's values are typed as Qwen3-Coder's (`_typed_param`, one reading for both): vLLM's glm45 parser keeps a
    string-typed value's text as it is and reads other values as JSON (or a Python literal); here each schema type
    reads as it does for qwen3_coder, and a value's text is exactly what is between its tags (GLM's templates write
    nothing around it: no newline is taken off)."""
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [QWEN3_CODER_TOOL]})
    plan = plan_tools(body, (FIXTURES / template).read_text())
    assert plan.markup == GLM_MARKERS

    def args(params: list[tuple[str, str]], sep: str) -> dict:
        parser = plan.new_parser()
        parser.feed(glm("f", params, sep))
        parser.finish()
        (call,) = parser.tool_calls
        return json.loads(call.arguments)

    for sep in ("\n", ""):
        assert args([("s", "123"), ("i", "42"), ("n", "5.0"), ("b", "True"), ("o", "{'k': True, 'v': None}"),
                     ("a", '[1, "x"]'), ("maybe", "null"), ("u", "7"), ("extra", "[1]"), ("word", "yes")], sep) == {
            "s": "123", "i": 42, "n": 5, "b": True, "o": {"k": True, "v": None}, "a": [1, "x"], "maybe": None,
            "u": 7, "extra": [1], "word": "yes"}
        assert args([("i", "forty"), ("b", "yes"), ("any", "123"), ("mixed", "12"), ("i2", " 5 ")], sep) == {
            "i": "forty", "b": "yes", "any": "123", "mixed": 12, "i2": 5}
        assert args([("s", "\n  two spaces\n\n"), ("s2", '"quoted"')], sep) == {"s": "\n  two spaces\n\n",
                                                                              "s2": '"quoted"'}


@pytest.mark.parametrize("template", ["glm_4_6.jinja", "glm_4_7_flash.jinja"])
def test_glm_reads_back_the_calls_its_template_writes(template):
    """The oracle is GLM's own template: the calls of a past assistant turn, as the template renders them (the
    markup the model is taught), read back by the parser as the same calls, typed by the tools' schemas: strings,
    numbers, booleans, null, objects and arrays, a string that looks like a number, and a call with no arguments."""
    from server.chat_template import render_messages
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    text = (FIXTURES / template).read_text()
    calls = [("f", {"s": "Zürich <b>", "i": 3, "n": 2.5, "b": False, "o": {"k": [1, None]}, "a": ["x", 2],
                    "maybe": None, "choice": "2", "mixed": "twelve"}), ("f", {}), ("f", {"s": "12", "u": True})]
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                   for i, (name, args) in enumerate(calls)]}]
    rendered = render_messages(text, history, add_generation_prompt=False, tools=[QWEN3_CODER_TOOL])
    turn = rendered[rendered.rindex("<|assistant|>") + len("<|assistant|>"):]
    assert turn.count("<tool_call>") == 3 and "<arg_key>" in turn
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [QWEN3_CODER_TOOL]})
    parser = plan_tools(body, text).new_parser()
    content, _ = parser.feed(turn)
    rest, _ = parser.finish()
    assert (content + rest).strip() in ("<think></think>", "</think>")  # (the turn's empty reasoning, not a call's)
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == calls


_BARE_TOOLS = {"get_weather": {"location": {"type": "string"}, "days": {"type": "integer"}}}


@pytest.mark.parametrize("text, content, calls", [
    # Qwen3-Coder leaving <tool_call> out: a known tool's whole <function=NAME> opens a call, its </function> ends it
    ("Checking.\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\nDone.", "Checking.\nDone.", [("get_weather", '{"location": "Paris", "days": 3}')]),
    ("A <function=get_weather>\n</function><tool_call>\n<function=get_weather>\n</function>\n</tool_call> B", "A B",
     [("get_weather", "{}"), ("get_weather", "{}")]),
    # cut off in a value: kept, its object left open
    ("<function=get_weather>\n<parameter=location>\nPa", "", [("get_weather", '{"location": "Pa"')]),
    # another name, or prose and code that merely begin like one: content
    ("Use <function=other> here.", "Use <function=other> here.", []),
    ("#include <functional>\nint x = f<function=get_weathe", "#include <functional>\nint x = f<function=get_weathe", []),
])
def test_qwen3_coder_calls_without_tool_call_tags(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    """As llama.cpp reads Qwen3-Coder's output: `<function=NAME>` of a tool the request gives, outside a
    `<tool_call>` block, is a call (they were content, markup and all); every split of the text alike."""
    from server.tool_parsers import GlmToolParser, QwenXmlToolParser

    for i in range(len(text) + 1):
        p = QwenXmlToolParser(_ids(), _BARE_TOOLS)
        got = p.feed(text[:i])[0] + p.feed(text[i:])[0] + p.finish()[0]
        assert (got, [(c.name, c.arguments) for c in p.tool_calls]) == (content, calls), i
    g = GlmToolParser(_ids(), _BARE_TOOLS)  # (GLM's markup has no <function=: its text stays content)
    assert g.feed(text)[0] + g.finish()[0] == text and not g.tool_calls


def test_kimi_k2_ids_count_the_conversations_calls():
    """A forced call's id, and one made for a header not in the templates' form, count the calls of the history
    (as vLLM does: Kimi's templates number a conversation's calls): after one earlier call it is
    `functions.NAME:1` (it was `:0` again, the earlier call's id)."""
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
               {"role": "user", "content": "And Lyon?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required", "auto"):
        body = ChatCompletionRequest.model_validate({"messages": history, "tools": [weather], "tool_choice": choice})
        parser = plan_tools(body, KIMI_TEMPLATE).new_parser()
        out = ('{"city": "Lyon"}' if isinstance(choice, dict) else '[{"name": "get_weather", "parameters": {}}]'
               if choice == "required" else KS_B + K_B + "get_weather" + K_ARGS + "{}" + K_E + KS_E)
        parser.feed(out)
        parser.finish()
        calls = parser.tool_calls if hasattr(parser, "tool_calls") else parser.calls
        assert [c.id for c in calls] == ["functions.get_weather:1"], choice
