"""Tool-calling conversations render exactly as transformers' `apply_chat_template` renders them.

The official templates of DeepSeek-V3, Qwen2.5-Instruct and Llama-3.1-Instruct disagree on what a
tool call's `arguments` is (a JSON string for DeepSeek, a mapping for the others) and on how None
content reads; `template_messages` feeds all three from the one shape an OpenAI client sends.
transformers is handed each template's own expected shape, with a tiny in-memory tokenizer: no
download, no model.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from server import chat_template  # noqa: E402
from server.chat_template import (  # noqa: E402
    ChatTemplateError,
    ToolArguments,
    render_chat,
    render_messages,
    template_messages,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
DATE = "14 Mar 2025"

# name: (file, bos, eos, arguments as a JSON string in transformers' input, allows several calls per turn)
TEMPLATES = {
    "deepseek_v3": ("deepseek_v3.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True, True),
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>", False, True),
    "llama3_1": ("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>", False, False),
    "qwen3_coder": ("qwen3_coder.jinja", None, "<|im_end|>", False, True),
    "glm_4_6": ("glm_4_6.jinja", None, "<|endoftext|>", False, True),
    "glm_4_7_flash": ("glm_4_7_flash.jinja", None, "<|endoftext|>", False, True),
    "kimi_k2": ("kimi_k2.jinja", "[BOS]", "[EOS]", False, True),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a place. Températures en °C — 天气",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "object",
                        "description": "Where to look",
                        "properties": {
                            "city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
                            "country": {"type": "string", "enum": ["CH", "FR", "JP", "中国"]},
                            "coords": {
                                "type": "array",
                                "items": {"type": "number"},
                                "minItems": 2,
                                "maxItems": 2,
                            },
                        },
                        "required": ["city"],
                    },
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["location"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Search flights between two airports.",
            "parameters": {
                "type": "object",
                "properties": {
                    "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "passengers": {
                        "type": "object",
                        "properties": {"adults": {"type": "integer"}, "children": {"type": "integer"}},
                    },
                    "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
                    "flexible": {"type": "boolean"},
                    "max_price": {"type": ["number", "null"]},
                },
                "required": ["from", "to"],
            },
        },
    },
]

# Compact, spaced and oddly spaced JSON text: DeepSeek must show each exactly as sent.
WEATHER_ARGS = '{"location":{"city":"Zürich","country":"CH","coords":[47.37,8.54]},"unit":"celsius","days":3}'
WEATHER_ARGS_2 = '{"location": {"city": "東京", "country": "JP"}, "unit": "fahrenheit"}'
FLIGHT_ARGS = '{ "from": "ZRH",  "to": "NRT", "passengers": {"adults": 2, "children": 0}, "flexible": true, ' \
              '"max_price": null, "cabin": "business" }'


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


SYSTEM = {"role": "system", "content": "You are a travel assistant. Réponds en français si on te parle français."}
ASK = {"role": "user", "content": "What's the weather in Zürich for the next 3 days?"}
ONE_CALL = [
    SYSTEM,
    ASK,
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "get_weather", WEATHER_ARGS)]},
    _tool("call_1", '{"forecast": [{"day": 1, "high": 12.5, "sky": "☀️"}, {"day": 2, "high": 9}]}'),
]
TWO_CALLS = [
    SYSTEM,
    {"role": "user", "content": "Weather in Tokyo, and flights ZRH→NRT for two adults in business?"},
    {"role": "assistant", "content": None, "tool_calls": [
        _call("call_a", "get_weather", WEATHER_ARGS_2),
        _call("call_b", "search_flights", FLIGHT_ARGS),
    ]},
    _tool("call_a", '{"high": 61, "sky": "rain"}'),
    _tool("call_b", '[{"flight": "LX160", "price": 4120.0}]'),
]

CONVERSATIONS = {
    "system_and_user": [SYSTEM, ASK],
    "user_only": [ASK],
    "one_call_then_result": ONE_CALL,
    "one_call_answered_then_user": ONE_CALL + [
        {"role": "assistant", "content": "Sunny tomorrow, 12.5 °C; cooler after."},
        {"role": "user", "content": "Et à Paris ?"},
    ],
    "call_with_content": [
        ASK,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("c9", "get_weather", WEATHER_ARGS)]},
        _tool("c9", "12 °C and sunny"),
    ],
    "two_calls_then_results": TWO_CALLS,
    "two_calls_answered_then_user": TWO_CALLS + [
        {"role": "assistant", "content": "Rainy in Tokyo; LX160 costs 4120 CHF."},
        {"role": "user", "content": "Book it."},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """A tokenizer object per template, for its special tokens only: rendering never tokenizes."""
    out = {}
    for name, (_, bos, eos, _, _) in TEMPLATES.items():
        vocab = {"<unk>": 0, eos: 1, **({bos: 2} if bos else {})}
        out[name] = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                            bos_token=bos, eos_token=eos, unk_token="<unk>")
    return out


def _template(name: str) -> str:
    return (FIXTURES / TEMPLATES[name][0]).read_text(encoding="utf-8")


def _hf_messages(messages: list[dict], args_as_text: bool) -> list[dict]:
    """What a transformers user hands each template: arguments as JSON text (DeepSeek) or as a dict.

    transformers drops `content: None`, which DeepSeek-V3's template then fails on, and which GLM's write as
    "None"; their users pass "" there (vLLM does), which DeepSeek's template renders as it renders None."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls", []):
            if not args_as_text:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if m.get("tool_calls") and m.get("content") is None:
            m["content"] = ""
    return out


def _both(name: str, tok, messages: list[dict], add_generation_prompt: bool, tools: list | None) -> tuple[str, str]:
    template = _template(name)
    _, bos, eos, args_as_text, _ = TEMPLATES[name]
    extra = {"tools": tools} if tools is not None else {}
    ours = render_messages(template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                           eos_token=eos, date_string=DATE, **extra)  # (as the server renders a request's)
    theirs = tok.apply_chat_template(_hf_messages(messages, args_as_text), chat_template=template, tokenize=False,
                                     add_generation_prompt=add_generation_prompt, date_string=DATE, **extra)
    return ours, theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tool_conversation_matches_transformers(hf_tokenizers, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    several_calls = any(len(m.get("tool_calls", [])) > 1 for m in messages)
    if several_calls and not TEMPLATES[name][4]:
        pytest.skip("this template refuses several calls in one turn (see test_template_raise_exception)")
    ours, theirs = _both(name, hf_tokenizers[name], messages, add_generation_prompt, TOOLS)
    assert ours == theirs
    if messages is ONE_CALL and name == "deepseek_v3":  # the text as sent, not a re-serialised dict
        assert WEATHER_ARGS in ours
    if messages is ONE_CALL and name == "qwen3_coder":  # a parameter at a time, objects as JSON
        assert "<parameter=unit>\ncelsius\n</parameter>" in ours
        location = json.loads(WEATHER_ARGS)["location"]
        assert f"<parameter=location>\n{json.dumps(location, ensure_ascii=False)}\n</parameter>" in ours
    elif messages is ONE_CALL and name.startswith("glm"):  # key and value pairs, a string as is, objects as JSON
        sep = "\n" if name == "glm_4_6" else ""
        location = json.dumps(json.loads(WEATHER_ARGS)["location"], ensure_ascii=False)
        assert (f"<tool_call>get_weather{sep}<arg_key>location</arg_key>{sep}<arg_value>{location}</arg_value>{sep}"
                f"<arg_key>unit</arg_key>{sep}<arg_value>celsius</arg_value>{sep}") in ours
    elif messages is ONE_CALL and name != "deepseek_v3":
        assert json.dumps(json.loads(WEATHER_ARGS), ensure_ascii=False) in ours
    if messages is ONE_CALL and name == "kimi_k2":  # the template writes its own id for the call, the client's
        # for the result (and a backslash and an `n` between it and the result: the template's text, as it is)
        assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{" in ours
        assert "<|im_system|>tool<|im_middle|>## Return of call_1\\n{" in ours


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_without_tools_matches_transformers(hf_tokenizers, name):
    for messages in (CONVERSATIONS["system_and_user"], CONVERSATIONS["user_only"]):
        ours, theirs = _both(name, hf_tokenizers[name], messages, True, None)
        assert ours == theirs
        assert "get_weather" not in ours


def test_template_raise_exception(hf_tokenizers):
    """Llama 3.1 refuses two calls in one turn, and tools with no user message, via raise_exception."""
    template = _template("llama3_1")
    for messages in (TWO_CALLS, [SYSTEM]):
        with pytest.raises(ChatTemplateError, match="tool-calls at once|no first user message"):
            render_chat(template, template_messages(messages), tools=TOOLS, bos_token="<|begin_of_text|>")
        with pytest.raises(Exception, match="tool-calls at once|no first user message"):
            hf_tokenizers["llama3_1"].apply_chat_template(_hf_messages(messages, False), chat_template=template,
                                                          tools=TOOLS, tokenize=False)


def test_tool_arguments_read_as_object_and_as_text():
    args = template_messages([{"role": "assistant", "tool_calls": [_call("c", "f", FLIGHT_ARGS)]}])[0]
    value = args["tool_calls"][0]["function"]["arguments"]
    assert isinstance(value, ToolArguments) and value == json.loads(FLIGHT_ARGS)
    assert str(value) == FLIGHT_ARGS and "<" + value + ">" == f"<{FLIGHT_ARGS}>"
    template = ("{% set a = messages[0].tool_calls[0].function.arguments %}"
                "{{ a | tojson }}|{{ a }}|{{ 'x' ~ a }}|{{ a | string }}|{{ a is mapping }}|{{ a.cabin }}"
                "|{{ a._text }}")
    out = render_chat(template, [{"role": "assistant", "tool_calls": args["tool_calls"]}])
    assert out.split("|") == [json.dumps(json.loads(FLIGHT_ARGS), ensure_ascii=False), FLIGHT_ARGS,
                              "x" + FLIGHT_ARGS, FLIGHT_ARGS, "True", "business", ""]


def test_empty_tool_arguments_are_an_empty_object():
    """A client's `"arguments": ""` (a call without arguments) renders as `{}`, as vLLM passes it: Qwen3's
    template wrote `"arguments": }` into the prompt, Llama 3.1's `"parameters": ""`."""
    for text in ("", "  "):
        value = template_messages([{"role": "assistant", "tool_calls": [_call("c", "f", text)]}])[0][
            "tool_calls"][0]["function"]["arguments"]
        assert value == {} and str(value) == "{}" and isinstance(value, ToolArguments)


def test_template_messages_normalises_like_transformers():
    sent = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [
            _call("a", "f", "not json {"), _call("b", "f", "[1, 2]"), _call("c", "f", '{"k": "v"}'),
        ]},
        {"role": "assistant", "content": "plain", "tool_calls": None},
        {"role": "assistant", "content": "empty list", "tool_calls": []},
        {"role": "assistant", "content": "ok", "reasoning_content": "because"},
        {"role": "assistant", "tool_calls": [{"id": "d", "function": {"name": "f", "arguments": {"k": 1}}}]},
    ]
    before = copy.deepcopy(sent)
    out = template_messages(sent)
    assert sent == before  # the caller's messages are left alone
    assert out[0] == {"role": "user", "content": "hi"}
    calls = [c["function"]["arguments"] for c in out[1]["tool_calls"]]
    assert out[1]["content"] is None
    assert [type(a) for a in calls] == [str, str, ToolArguments] and calls[:2] == ["not json {", "[1, 2]"]
    assert out[2] == {"role": "assistant", "content": "plain"}
    assert out[3] == {"role": "assistant", "content": "empty list"}
    # under every name templates read it: vLLM's `reasoning` too (a template reading only it lost it)
    assert out[4]["thinking"] == out[4]["reasoning_content"] == out[4]["reasoning"] == "because"
    args = out[5]["tool_calls"][0]["function"]["arguments"]
    assert out[5]["content"] is None and out[5]["tool_calls"][0]["type"] == "function"
    assert isinstance(args, ToolArguments) and str(args) == '{"k": 1}'


@pytest.mark.parametrize("template", [
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}",
    "{{ tools | tojson(false, 2) }}",  # transformers' positional order: ensure_ascii, indent
    "{{ tools | tojson(true) }}",
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "{% set d = dict(a=1, b=[2]) %}{{ d | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|{{ date_string is defined }}",
])
def test_environment_matches_transformers(hf_tokenizers, template):
    tok = hf_tokenizers["llama3_1"]
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "bye"}]
    tools = TOOLS if "tools |" in template else None
    ours = render_chat(template, template_messages(messages), bos_token=tok.bos_token, eos_token=tok.eos_token,
                       **({"tools": tools} if tools else {}))
    theirs = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                                     **({"tools": tools} if tools else {}))
    assert ours == theirs


def test_sandbox_holds():
    for template in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
                     "{{ messages.append(1) }}", "{{ ''.__class__.__mro__ }}"):
        with pytest.raises(ChatTemplateError):
            render_chat(template, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):  # a template's own Python error is still ours
        render_chat("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template, words", [
    ("{{ 'x' * 10**10 }}", "repeats a sequence 10000000000 times"),
    ("{{ 10**10 * 'x' }}", "repeats a sequence"),
    ("{{ [1, 2] * 10**9 }}", "repeats a sequence"),
    ("{{ 10 ** 100000000 }}", "to the power 100000000"),
    ("{% for i in range(100000) %}{{ 'xyz' * 1000 }}{% endfor %}", "more than 16777216 characters"),
    # nested loops that write nothing: minutes of CPU, no text to count
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops ran more than"),
    ("{% set s = 'ab' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "loops ran more than"),
    ("{% for i in range(100000) if i < 0 %}{% else %}{% for k in range(100) %}{% for j in range(100000) %}"
     "{% if loop.last %}{% endif %}{% endfor %}{% endfor %}{% endfor %}", "loops ran more than"),
    ("{% for j in range(100) recursive %}{% for k in range(100000) %}{% endfor %}{% endfor %}", "loops ran more than"),
    # few iterations, each filtering a long text: the time is bounded
    ("{% set s = 'ab' * 4000000 %}{% for i in range(2000) %}{{ (s | list) | length }}{% endfor %}",
     "built a list of 8000000 items"),  # (each time round: the time limit stopped it later, before the list's bound)
    ("{% set s = 'ab' * 400000 %}{% for i in range(20000) %}{{ (s | list) | length }}{% endfor %}", "ran for more than 5 s"),
    # no loop at all: a macro calling itself twice (2^40 calls), and single filters asked for gigabytes or
    # minutes (they hung the server's render threads, or took seconds and GBs each)
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}", "ran for more than 5 s"),
    ("{{ [1, 2] | slice(100000000) | list | length }}", "passes 100000000 to the filter 'slice'"),
    ("{{ 'x' | center(3000000000) }}", "filter 'center'"),
    ("{{ 'x\ny' | indent(3000000000) }}", "filter 'indent'"),
    ("{{ messages | tojson(indent=100000000) }}", "filter 'tojson'"),
    ("{{ ('a ' * 8000000) | wordwrap(1) }}", "wraps a text longer than"),
    ("{% set l = [0] * 16000000 %}{{ l | sort | sum }}", "repeats a sequence 16000000 times"),
    ("{{ (['ab'] * 1000000) | join('x' * 1000) }}", "filter 'join' made a text longer than"),
    # a text or list that doubles each time round: 2^40 characters after 40 joins (a template took 6.5 GB)
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
     "built a text of 33554432 characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "built a text of"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "built a list of"),
    ("{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | join }}", "passes texts of more than 16777216 characters"),
    # a format's width builds its text at once (a gigabyte before the size was looked at)
    ("{{ '%0999999999d' | format(1) }}", "formats with a field '%0999999999'"),
    ("{{ '%(a)0999999s' % {'a': 1} }}", "formats with a field"),
    ("{{ '{:>999999999}'.format(1) }}", "formats with a field '{:>999999999'"),
    ("{{ '{0:.9999999}'.format_map({}) }}", "formats with a field"),
    # and what an adversarial review found past those: widths as arguments, str methods, macros that double
    # their output, lists doubled by a filter, containers written as text, a format scanned for seconds
    ("{{ ('%*d' % (1000000000, 1)) | length }}", "a width from its arguments .1000000000"),
    ("{{ '{:{}}'.format('x', 200000000) }}", "a width from its arguments .200000000"),
    ("{{ 'x'.center(1000000000) }}", "asks str.center for 1000000000 characters"),
    ("{{ 'x'.zfill(1000000000) }}", "asks str.zfill"),
    ("{% set s = 'x' * 10000000 %}{{ ''.join([s] * 20) }}", "str.join would build"),
    ("{% set s = 'x' * 1000000 %}{{ s.replace('x', 'y' * 200000) }}", "str.replace would build"),
    ("{% macro d(n) %}{% if n %}{% set x = d(n-1) %}{{x}}{{x}}{% else %}x{% endif %}{% endmacro %}{{ d(34) | length }}",
     "built a text of"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = [ns.l, ns.l] | sum(start=[]) %}{% endfor %}",
     "built a list of"),
    ("{{ ('x\n' * 1000000) | indent(65536) }}", "indents 1000000 lines by 65536"),
    ("{% set s = 'x' * 10000000 %}{{ ([[s]] * 100) | map('first') | join }}", "passes texts of more than"),
    ("{% set s = 'x' * 10000000 %}{{ [s] * 100 }}", "writes a value of more than"),
    ("{% set s = 'x' * 10000000 %}{{ ([s] * 100) | string | length }}", "filter 'string'"),
    ("{{ ('%(' * 8000000) % {} }}", "formats with a text of 16000000 characters"),
])
def test_sandbox_bounds_what_a_template_builds(template, words, monkeypatch):
    """A model file's template asking for a 10 GB string, a huge integer or a huge text is refused at once
    (it used to build them, for every chat request); what a real template does is untouched."""
    if "loops ran more than" in words:  # the loop budget is what must stop these, on a busy machine too
        monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 60.0)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        render_chat(template, [{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 30


def test_sandbox_bounds_leave_real_templates_alone(monkeypatch):
    """What real templates do fits the bounds, and the loop budget is each rendering's own."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 60.0)  # (900,000 iterations on a busy machine)
    ok = "{{ '-' * 3 }}{{ 2 ** 10 }}{{ messages[0].content * 2 }}"
    assert render_chat(ok, [{"role": "user", "content": "ab"}]) == "---1024abab"
    filters = "{{ messages[0].content | center(6) | trim | indent(2) }}{{ [3, 1] | sort | join(',') }}{{ [1,2] | slice(2) | list }}"
    assert render_chat(filters, [{"role": "user", "content": "ab"}]) == "ab1,3[[1], [2]]"
    values = "{{ max_len | default(131072) }} {{ '%d' | format(200000) }} {{ 1000000 | string }}"  # values, not sizes
    assert render_chat(values, [{"role": "user", "content": "ab"}]) == "131072 200000 1000000"
    formats = ("{{ '%5.2f|%-3s|' % (3.14159, 'a') }}{{ '{0:>6.1f} {1}'.format(2.25, 'b') }}"
               "{{ '{\"max\": 100000} %s' % 'c' }}{{ messages[0].content ~ '/' ~ messages[0].content + '!' }}")
    assert render_chat(formats, [{"role": "user", "content": "ab"}]) == ' 3.14|a  |   2.2 b{"max": 100000} cab/ab!'
    literal = "{{ '%d%% 1000000' % 5 }} {{ '{{\"max_tokens\": 1000000}} {}'.format('x') }} {{ 'ab'.center(6) }}"
    assert render_chat(literal, [{"role": "user", "content": "ab"}]) == '5% 1000000 {"max_tokens": 1000000} x   ab  '
    loops = ("{% for m in messages %}{% for i in range(m.content | int) if i % 2 %}{% if loop.first or loop.last %}"
             "{{ loop.index }}/{{ loop.length }} {% endif %}{% else %}none{% endfor %}{% endfor %}")
    assert render_chat(loops, [{"role": "user", "content": "5"}, {"role": "user", "content": "0"}]) == "1/2 2/2 none"
    for _ in range(2):  # 900,000 iterations each, 1.8M together: past the budget, were it shared
        assert render_chat(loops, [{"role": "user", "content": "99999"}] * 9) == "1/49999 49999/49999 " * 9


@pytest.mark.parametrize("final", ["The weather in Zürich is", "Sure —  \n", "  leading space, then  "],
                         ids=["plain", "trailing-space", "leading-space"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_continued_final_message_matches_transformers(hf_tokenizers, name, final):
    """A final assistant message left open (continue_final_message, DeepSeek's prefix) is cut where
    transformers' `continue_final_message` cuts it, whether the template trims the text (Llama 3.1) or not."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": final}]
    template = _template(name)
    _, bos, eos, _, _ = TEMPLATES[name]
    ours = render_chat(template, template_messages(messages), add_generation_prompt=False, continue_final_message=True,
                       bos_token=bos, eos_token=eos, date_string=DATE)
    theirs = hf_tokenizers[name].apply_chat_template(messages, chat_template=template, tokenize=False,
                                                     add_generation_prompt=False, continue_final_message=True,
                                                     date_string=DATE)
    assert ours == theirs
    assert ours.rstrip().endswith(final.strip()) and not ours.endswith(eos)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_final_message_of_whitespace_is_continued(name):
    """A prefill of whitespace ("\n", a common trick) is text to continue (it was a 400): rendered as the same
    message with text before the whitespace, less that text, whether the template trims the text or not."""
    template = _template(name)
    _, bos, eos, _, _ = TEMPLATES[name]
    for space in ("\n", "  ", " \n"):
        ours = [render_chat(template, template_messages([{"role": "user", "content": "Weather?"},
                                                         {"role": "assistant", "content": text}]),
                            add_generation_prompt=False, continue_final_message=True, bos_token=bos, eos_token=eos,
                            date_string=DATE) for text in ("Hi" + space, space)]
        head, tail = ours[0].rsplit("Hi", 1)
        assert ours[1] == head + tail and not ours[1].endswith(eos), (name, space, ours)


def test_a_final_message_the_template_rewrites_cannot_be_continued():
    """DeepSeek-V3's template drops an assistant message's text up to `</think>`: that text cannot be found,
    so continuing it is refused rather than cut at the wrong place."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hmm</think>Hello"}]
    def render(final: str) -> str:
        return render_chat(_template("deepseek_v3"), template_messages([messages[0], {**messages[1], "content": final}]),
                           add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        render(messages[-1]["content"])
    assert render("Hello").endswith("<｜Assistant｜>Hello")


def test_tool_results_reach_a_template_that_drops_the_tool_role():
    """A template that writes only system, user and assistant turns (and reads no `tool_calls`) would drop
    a tool result without a word: the result goes in as a user turn's `<tool_response>` block instead,
    while a template that writes every role keeps it a `tool` turn."""
    from server.tools import with_call_markup

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    narrow = ("{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}{% elif m.role == 'assistant' %}"
              "<A>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<A>{% endif %}")
    generic = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert "18C and sunny" not in render_chat(narrow, template_messages(history[:1] + history[2:]))  # the loss
    text = render_chat(narrow, template_messages(with_call_markup(history, narrow)))
    assert text.endswith('<U><tool_response>\n18C and sunny\n</tool_response><A>'), text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    kept = render_chat(generic, template_messages(with_call_markup(history, generic)))
    assert kept.endswith("<tool><tool_response>\n18C and sunny\n</tool_response>"), kept


# Qwen3's way with reasoning (its template, cut to what matters here): an assistant turn writes its
# `reasoning_content` in a think block
QWEN3_LIKE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>' + call.function.name + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Gemma 3's way with content: it walks the parts, trimming each
GEMMA_LIKE = (
    "{%- for message in messages %}{{- '<start_of_turn>' + message.role + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for item in message['content'] %}{%- if item['type'] == 'text' %}{{- item['text'] | trim }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


# Qwen3.5's way: the parts are walked in a macro the message's content is given to
MACRO_LIKE = (
    "{%- macro render_content(content, do_trim) %}{%- if content is string %}{{- content | trim if do_trim else content }}"
    "{%- else %}{%- for item in content %}{%- if item.type == 'text' %}{{- item.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"
    "{{- render_content(message.content, true) | trim }}{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


@pytest.mark.parametrize("template", [QWEN3_LIKE, GEMMA_LIKE, MACRO_LIKE], ids=["reasoning", "parts", "macro-parts"])
def test_history_reasoning_and_text_parts_render_as_transformers(hf_tokenizers, template):
    """An earlier reply's reasoning sent back (`reasoning_content`, or vLLM's `reasoning`) reaches the
    template; content sent as text parts reaches a template that walks the parts as parts (joined by
    newlines only for templates that read content as a string)."""
    from server.chat_template import loops_over_content
    from server.protocol import ChatCompletionRequest

    for key in ("reasoning_content", "reasoning"):
        parts = [{"type": "text", "text": "Weather in Paris? "}, {"type": "text", "text": " Be brief."}]
        messages = [{"role": "user", "content": parts if template is not QWEN3_LIKE else "Weather in Paris?"},
                    {"role": "assistant", "content": "It is sunny.", key: "\nI should look it up.\n"},
                    {"role": "user", "content": "And tomorrow?"}]
        body = ChatCompletionRequest.model_validate({"messages": messages})
        ours = render_chat(template, template_messages(body.openai_messages(parts=loops_over_content(template))))
        hf_messages = [{**m, "reasoning_content": m.pop("reasoning")} if "reasoning" in m else m
                       for m in copy.deepcopy(messages)]
        theirs = hf_tokenizers["qwen2_5"].apply_chat_template(hf_messages, chat_template=template, tokenize=False,
                                                              add_generation_prompt=True)
        assert ours == theirs
        if template is QWEN3_LIKE:
            assert "<think>\nI should look it up.\n</think>" in ours
        elif template is GEMMA_LIKE:
            assert "Weather in Paris?Be brief." in ours
        else:  # (joined by newlines: "Paris? \n Be brief.")
            assert "Weather in Paris?  Be brief." in ours
    assert loops_over_content(GEMMA_LIKE) and loops_over_content(MACRO_LIKE) and not loops_over_content(QWEN3_LIKE)


# ----------------------------------------------------------------------------- templates of llama.cpp's collection
# (copied into tests/fixtures/chat_templates, see its README): the shapes they disagree on


def _fixture(file: str) -> str:
    return (FIXTURES / file).read_text(encoding="utf-8")


# the OpenAI SDK's round trip: the assistant turn that called a tool comes back with `content: null`
SDK_ROUND_TRIP = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c00000001", "get_weather", '{"city": "Paris"}')]},
    _tool("c00000001", "21C"),
]


@pytest.mark.parametrize("file", ["glm_4_6.jinja", "gpt_oss.jinja", "ministral3.jinja"])
def test_a_turn_that_only_calls_tools_renders_as_vllm_hands_it(hf_tokenizers, file):
    """`content: null` beside tool calls reaches a template as "" (vLLM's), unless it tests a content `is none`
    and renders with None (DeepSeek's, above): GLM's wrote a literal "None", gpt-oss's failed on it (a 400),
    and Ministral 3's, which tests `is none` elsewhere, failed on it too."""
    from server.chat_template import render_messages

    template, tok = _fixture(file), hf_tokenizers["qwen2_5"]
    ours = render_messages(template, SDK_ROUND_TRIP, add_generation_prompt=True, tools=TOOLS, eos_token=tok.eos_token)
    vllm_shape = copy.deepcopy(SDK_ROUND_TRIP)
    vllm_shape[1]["content"] = ""
    vllm_shape[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    theirs = tok.apply_chat_template(vllm_shape, chat_template=template, tokenize=False, add_generation_prompt=True,
                                     tools=TOOLS)
    assert ours == theirs
    assert "None" not in ours and "Paris" in ours and "21C" in ours


@pytest.mark.parametrize("template", ["glm_4_6.jinja", GEMMA_LIKE], ids=["glm_4_6", "gemma_like"])
def test_continuing_a_final_message_of_text_parts_matches_transformers(hf_tokenizers, template):
    """A final message sent as text parts is continued from its last text part, as transformers does
    (it was a 400 'needs its text content' for templates that walk the parts)."""
    from server.chat_template import loops_over_content
    from server.protocol import ChatCompletionRequest

    template = template if template is GEMMA_LIKE else _fixture(template)
    messages = [{"role": "user", "content": "Write a haiku."},
                {"role": "assistant", "content": [{"type": "text", "text": "Autumn"}, {"type": "text", "text": "moon"}]}]
    body = ChatCompletionRequest.model_validate({"messages": messages, "continue_final_message": True,
                                                 "add_generation_prompt": False})
    assert loops_over_content(template)
    ours = render_chat(template, template_messages(body.openai_messages(parts=True)), add_generation_prompt=False,
                       continue_final_message=True)
    theirs = hf_tokenizers["qwen2_5"].apply_chat_template(messages, chat_template=template, tokenize=False,
                                                          add_generation_prompt=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("moon")


def _chat_prompt(template: str, request: dict, named: dict[str, str] | None = None) -> str:
    """The prompt `serving.chat_prompt` renders for `request` with the default model's tokenizer under `template`
    (and the `named` other templates)."""
    import dataclasses

    from models.loader.tokenizer import load_tokenizer
    from server.metrics import Metrics
    from server.protocol import ChatCompletionRequest
    from server.serving import chat_prompt
    from server.state import ServerState

    try:
        tok = load_tokenizer("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    state = ServerState(model_name="m", metrics=Metrics("m"), tool_call_parser="hermes",
                        tokenizer=dataclasses.replace(tok, chat_template=template, named_chat_templates=named or {}))
    return chat_prompt(state, ChatCompletionRequest.model_validate(request))[0]


# Hermes-2-Pro's and Command-R's layout: a plain default and a `tool_use` template that renders the tools
NAMED_DEFAULT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
NAMED_TOOL_USE = ("<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
                  "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.mark.parametrize("request_tools, tool_choice", [(True, None), (True, "required"), (True, "none"),
                                                        (False, None)])
def test_a_tool_use_template_renders_requests_with_tools(hf_tokenizers, request_tools, tool_choice):
    """A model with named templates: transformers renders with `tool_use` when it is given tools, with the
    default otherwise (and `tool_choice: none` shows no tools)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    request: dict = {"messages": messages}
    if request_tools:
        request["tools"] = TOOLS
    if tool_choice:
        request["tool_choice"] = tool_choice
    ours = _chat_prompt(NAMED_DEFAULT, request, {"tool_use": NAMED_TOOL_USE})
    tok = copy.deepcopy(hf_tokenizers["qwen2_5"])
    tok.chat_template = {"default": NAMED_DEFAULT, "tool_use": NAMED_TOOL_USE}  # transformers picks one
    shown = request_tools and tool_choice != "none"
    theirs = tok.apply_chat_template(messages, tools=TOOLS if shown else None, tokenize=False,
                                     add_generation_prompt=True)
    if tool_choice == "required":  # the forced call's instructions join the conversation; the layout is tool_use's
        assert ours.startswith("<tools>get_weather;search_flights;</tools>") and ours.endswith("[assistant]")
    else:
        assert ours == theirs


def test_tools_reach_a_template_without_a_system_role(hf_tokenizers):
    """Gemma 2's template refuses the system role: the tool prompt a template that ignores tools gets goes
    at the head of the first user turn (every request with tools was a 400 'System role not supported')."""
    template = _fixture("gemma2.jinja")
    text = _chat_prompt(template, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS})
    head = text.split("<start_of_turn>user\n", 1)[1]
    assert "get_weather" in head and head.index("get_weather") < head.index("Weather in Paris?")
    assert "<start_of_turn>model\n" in text and "system" not in text.split("get_weather")[0]


def test_parallel_tool_results_reach_an_alternating_template_as_one_turn():
    """A template that writes no tool messages (Gemma 2's, which also demands alternating roles) gets the
    results of parallel calls as one user turn, as Hermes templates write them (each its own user turn was a
    400 'roles must alternate': parallel_tool_calls is on by default)."""
    template = _fixture("gemma2.jinja")
    text = _chat_prompt(template, {"messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "get_weather", '{"city": "Paris"}'),
                                                              _call("c2", "get_weather", '{"city": "Rome"}')]},
        _tool("c1", "18C"), _tool("c2", "24C")], "tools": TOOLS})
    turn = text.split("<start_of_turn>user\n")[-1]
    assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>" in turn
    assert text.count("<start_of_turn>user") == 2 and text.endswith("<start_of_turn>model\n")


def test_reasoning_effort_and_an_empty_tool_list_reach_the_template():
    """OpenAI's `reasoning_effort` reaches a template reading it (gpt-oss's; it was dropped: `Reasoning: medium`
    whatever was asked), `chat_template_kwargs` winning; `tools: []` is [] to the template, as transformers
    hands it (a tool_use template iterating `tools` failed on None)."""
    template = ("{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
                "{% if tools is not none %}<tools {{ tools | length }}>{% for t in tools %}{% endfor %}{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    user = [{"role": "user", "content": "hi"}]
    assert _chat_prompt(template, {"messages": user}) == "<user>hi"
    assert _chat_prompt(template, {"messages": user, "reasoning_effort": "high"}) == "<effort high><user>hi"
    assert _chat_prompt(template, {"messages": user, "reasoning_effort": "high",
                                   "chat_template_kwargs": {"reasoning_effort": "low"}}) == "<effort low><user>hi"
    assert _chat_prompt(template, {"messages": user, "tools": []}) == "<tools 0><user>hi"
    with pytest.raises(Exception, match="reasoning_effort"):
        _chat_prompt(template, {"messages": user, "reasoning_effort": "extreme"})
    for name in ("__mlaserve_loop_guard", "namespace"):  # the sandbox's own names, not template variables
        with pytest.raises(Exception, match=name):
            _chat_prompt(template, {"messages": user, "chat_template_kwargs": {name: "x"}})


def test_a_system_message_of_text_parts_takes_the_tool_prompt():
    """A system message sent as parts gets the tool prompt in it, not a second system message first (Gemma 3
    then refused the conversation: roles must alternate)."""
    alternating = ("{% if messages[0].role == 'system' %}{% set rest = messages[1:] %}<S>{{ messages[0].content }}"
                   "{% else %}{% set rest = messages %}{% endif %}{% for m in rest %}"
                   "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}"
                   "{% endif %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}")
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]}
    text = _chat_prompt(alternating, {"messages": [system, {"role": "user", "content": "Weather?"}], "tools": TOOLS})
    assert text.startswith("<S>Be brief.\nBe kind.\n\n") and "get_weather" in text.split("<user>")[0]


def test_call_markup_keeps_text_parts():
    """For a template that reads no `tool_calls`, an assistant turn's text sent as parts stays beside its
    `<tool_call>` block (it was dropped) and a tool result sent as parts is wrapped (it stayed a bare `tool` turn)."""
    from server.tools import with_call_markup

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}],
                "tool_calls": [_call("c1", "weather", '{"city": "Paris"}')]},
               {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18C"}]}]
    out = with_call_markup(history, GEMMA_LIKE)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[1]["content"] == f"Let me check.\n{call}"
    assert out[2]["content"] == "<tool_response>\n18C\n</tool_response>"


def test_documents_reach_the_template(hf_tokenizers):
    """vLLM's `documents` (a retrieval template reads them, as Command-R's and Granite's do): rendered as
    transformers renders them (the field was dropped); without documents the template sees none."""
    template = ("{% if documents %}{% for d in documents %}<doc {{ loop.index0 }}>{{ d.title }}: {{ d.text }}"
                "{% endfor %}{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "Where is the tower?"}]
    docs = [{"title": "Eiffel", "text": "The tower is in Paris."}, {"title": "Pisa", "text": "It leans."}]
    theirs = hf_tokenizers["qwen2_5"].apply_chat_template(messages, chat_template=template, documents=docs,
                                                          tokenize=False, add_generation_prompt=False)
    assert _chat_prompt(template, {"messages": messages, "documents": docs, "add_generation_prompt": False}) == theirs
    assert theirs.startswith("<doc 0>Eiffel: The tower is in Paris.<doc 1>Pisa")
    assert _chat_prompt(template, {"messages": messages, "add_generation_prompt": False}) == "<user>Where is the tower?"


def test_mistral_tools_render_parse_and_come_back():
    """A Mistral template (Ministral 3's): tools render (the request was a 400: no parser for `[TOOL_CALLS]`),
    the mistral parser reads its calls, and every way of calling (auto, named, required) makes 9-character
    ids, which Mistral's templates check when the calls come back; that history renders."""
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    template = _fixture("ministral3.jinja")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    assert "[AVAILABLE_TOOLS]" in _chat_prompt(template, {"messages": ask, "tools": TOOLS})
    ids = []
    for choice, output in ((None, '[TOOL_CALLS]get_weather[ARGS]{"location": {"city": "Paris"}}'),
                           ({"type": "function", "function": {"name": "get_weather"}}, '{"location": {"city": "Paris"}}'),
                           ("required", '[{"name": "get_weather", "parameters": {"location": {"city": "Paris"}}}]')):
        body = ChatCompletionRequest.model_validate({"messages": ask, "tools": TOOLS, "tool_choice": choice})
        parser = plan_tools(body, template).new_parser()
        parser.feed(output)
        parser.finish()
        (call,) = parser.tool_calls if not hasattr(parser, "calls") else parser.calls
        assert call.name == "get_weather" and json.loads(call.arguments) == {"location": {"city": "Paris"}}
        ids.append(call.id)
    assert all(len(i) == 9 and i.isalnum() for i in ids), ids
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": '{"location": {"city": "Paris"}}'}}]},
        {"role": "tool", "tool_call_id": ids[0], "content": "21 C"}]
    text = _chat_prompt(template, {"messages": history, "tools": TOOLS})
    assert '[TOOL_CALLS]get_weather[ARGS]{"location": {"city": "Paris"}}' in text and "[TOOL_RESULTS]21 C" in text


def test_kimi_k2_calls_come_back_with_the_ids_the_model_wrote(hf_tokenizers):
    """Kimi-K2's template writes a past call as `functions.NAME:I` (I its place in the turn) and its result as
    `## Return of {tool_call_id}`: the ids the `kimi_k2` parser gives the calls (the model's own) are what the
    client sends back, so each result names its call as the call is written, here and in transformers."""
    from server.tool_parsers import KimiK2ToolParser, parse_tool_calls

    output = "Checking." + KimiK2ToolParser.written("", [("get_weather", json.loads(WEATHER_ARGS_2)),
                                                          ("search_flights", json.loads(FLIGHT_ARGS))])
    content, calls = parse_tool_calls("kimi_k2", output)
    assert content == "Checking." and [c.id for c in calls] == ["functions.get_weather:0", "functions.search_flights:1"]
    messages = [SYSTEM, TWO_CALLS[1], {"role": "assistant", "content": content,
                                       "tool_calls": [_call(c.id, c.name, c.arguments) for c in calls]},
                _tool(calls[0].id, "rain"), _tool(calls[1].id, "LX160")]
    ours, theirs = _both("kimi_k2", hf_tokenizers["kimi_k2"], messages, True, TOOLS)
    assert ours == theirs
    for call, result in zip(calls, ("rain", "LX160")):
        assert f"<|tool_call_begin|>{call.id}<|tool_call_argument_begin|>" in ours
        assert f"<|im_middle|>## Return of {call.id}\\n{result}<|im_end|>" in ours
    assert ours.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert ours.endswith("<|im_assistant|>assistant<|im_middle|>")
