"""Constrained decoding below the server: the grammar backend, the sampler's mask, the keyword table.

The oracle for "valid" is `jsonschema` (not written here); xgrammar is what we build on, and the
tests check the claims the server makes about it (every keyword it lets through is enforced)."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import jsonschema
import pytest
import torch

from executor.grammar import Grammar, GrammarBackend, GrammarError, apply_grammar_masks
from executor.sampler import Sampler, SamplingRow
from scheduler.sampling_params import SamplingParams
from scheduler.sampling_params import ParamError
from server.structured import ENFORCED, FORMATS, json_schema_output

xgr = pytest.importorskip("xgrammar")

# a character-level vocabulary: any text has exactly one spelling, so "does the grammar accept this
# text" is a plain question; STOP is the stop id and SPECIAL another special token, as real tokenizers have
CHARS = [chr(c) for c in range(32, 127)]
STOP = len(CHARS)
SPECIAL = STOP + 1
VOCAB = SPECIAL + 1


@pytest.fixture(scope="module")
def backend():
    from tokenizers import AddedToken, Tokenizer, models

    vocab = {c: i for i, c in enumerate(CHARS)} | {"</s>": STOP, "<|x|>": SPECIAL}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.add_special_tokens([AddedToken("</s>", special=True), AddedToken("<|x|>", special=True)])
    b = GrammarBackend(tok, len(vocab), [STOP])
    yield b
    b.shutdown()


def test_special_tokens_are_never_text_and_stop_only_ends_a_document(backend):
    """Read as text, a special token fitted inside a JSON string and the stop token's text matched `.+`:
    the document could end empty on its first token."""
    for kind, spec in (("regex", ".+"), ("regex", "[^x]+"), ("json_schema", '{"type": "string"}')):
        g = backend.grammar(backend.compile(kind, spec, "x"))
        mask = xgr.allocate_token_bitmask(1, VOCAB)
        for ch in ('' if kind == "regex" else '"') + "ab":
            g.fill(mask, 0)
            words = mask[0].numpy().view("uint32")
            allowed = {i for i in range(VOCAB) if (words[i // 32] >> (i % 32)) & 1}
            assert SPECIAL not in allowed and (STOP in allowed) == (kind == "regex" and ch == "b"), (spec, ch)
            assert g.accept(CHARS.index(ch))
        assert not g.accept(SPECIAL)


def accepts(backend: GrammarBackend, compiled, text: str) -> bool:
    """Whether the grammar takes `text` as a whole document (then the stop id)."""
    g = backend.grammar(compiled)
    return all(g.accept(CHARS.index(ch)) for ch in text) and g.accept(STOP) and g.terminated


# keyword -> (schema, a valid instance, an instance that breaks only this keyword); patterns are matched
# whole (anchored), so "^x" admits the key "x" only
KEYWORD_CASES = {
    "type": ({"type": "integer"}, "3", '"3"'),
    "enum": ({"enum": ["a", 1]}, "1", '"b"'),
    "const": ({"const": {"a": 1}}, '{"a":1}', '{"a":2}'),  # the constant is written compactly
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', "null"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, "4", "2"),
    "$ref": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "5", '"5"'),
    "$defs": ({"$defs": {"n": {"type": "boolean"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
              '{"a": true}', '{"a": 1}'),
    "definitions": ({"definitions": {"n": {"type": "null"}}, "type": "array", "items": {"$ref": "#/definitions/n"}},
                    "[null]", "[1]"),
    "properties": ({"type": "object", "properties": {"a": {"type": "string"}}}, '{"a": "x"}', '{"a": 1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                             '{"a": 1}', '{"b": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"x": 1}', '{"x": "a"}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"a": 1}', '{"b": 1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, '{"a": 1}', "{}"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "a"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', "[1]"),
    "minItems": ({"type": "array", "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "maxItems": 1}, "[1]", "[1, 2]"),
    "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, '"12"', '"1a"'),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "format": ({"type": "string", "format": "date"}, '"2024-02-29"', '"yesterday"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "1.5", "1.25"),
    "maximum": ({"type": "integer", "maximum": 10}, "10", "11"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, "1", "0"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 0.5}, "0.25", "0.5"),
}


def test_every_keyword_the_server_allows_is_enforced(backend):
    assert set(KEYWORD_CASES) == ENFORCED
    for keyword, (schema, good, bad) in KEYWORD_CASES.items():
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert validator.is_valid(json.loads(good)) and not validator.is_valid(json.loads(bad)), keyword  # the oracle
        compiled = backend.compile("json_schema", json.dumps(schema), "response_format")
        assert accepts(backend, compiled, good), keyword
        assert not accepts(backend, compiled, bad), keyword


@pytest.mark.parametrize("fmt,bad", [("email", '"a b"'), ("date-time", '"now"'), ("uuid", '"1234"'),
                                     ("ipv4", '"1.2.3"'), ("uri", '"no scheme"'), ("time", '"noon"')])
def test_formats_are_enforced(backend, fmt, bad):
    assert fmt in FORMATS
    compiled = backend.compile("json_schema", json.dumps({"type": "string", "format": fmt}), "response_format")
    assert not accepts(backend, compiled, bad)


def served(backend: GrammarBackend, schema: dict):
    """The grammar the server compiles for a response_format schema (checked and rewritten first)."""
    return backend.compile("json_schema", json_schema_output(schema, "response_format.json_schema.schema").spec,
                           "response_format")


def sample(backend: GrammarBackend, compiled, rng, max_chars: int = 160) -> str | None:
    """A random document of the grammar: each character drawn among those it allows next (the stop id
    one time in four where allowed); None if it runs past max_chars."""
    g, out = backend.grammar(compiled), []
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    for _ in range(max_chars):
        g.fill(mask, 0)
        words = mask[0].numpy().view("uint32")
        allowed = [i for i in range(VOCAB) if (words[i // 32] >> (i % 32)) & 1]
        if STOP in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return "".join(out)
        pick = rng.choice([i for i in allowed if i != STOP])
        assert g.accept(pick)
        out.append(CHARS[pick])
    return None


CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_served_format_writes_only_values_its_checker_accepts(backend, fmt):
    """Random documents of each format's served grammar against jsonschema's format checkers (with its
    format-nongpl extra: rfc3339-validator, fqdn, rfc3986-validator, isoduration, ...). xgrammar's own
    rules wrote 2023-11-31, 23:59:60, 01.2.3.4 and 70-character host labels; those formats are served as
    patterns (server.structured.FORMAT_PATTERNS)."""

    if fmt not in CHECKER.checkers:
        pytest.skip(f"jsonschema has no checker for {fmt} here (its format-nongpl extra is missing)")
    compiled, rng, n = served(backend, {"type": "string", "format": fmt}), random.Random(fmt), 0
    for _ in range(120):
        doc = sample(backend, compiled, rng)
        if doc is not None:
            n += 1
            assert CHECKER.conforms(json.loads(doc), fmt), (fmt, doc)
    assert n >= 30


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", ["2024-02-29", "2000-02-29", "0001-01-31", "2023-12-31"], ["2023-02-29", "1900-02-29", "2023-11-31", "0000-01-01"]),
    ("date-time", ["2023-04-30T23:59:59Z", "2024-02-29T00:00:00.5+05:30"], ["2023-04-31T10:00:00Z", "2023-01-01T23:59:60Z"]),
    ("time", ["12:00:00Z", "23:59:59.123456-11:00"], ["24:00:00Z", "12:00:60Z", "12:00:00"]),
    ("ipv4", ["0.0.0.0", "255.255.255.255", "10.20.30.40"], ["01.2.3.4", "256.1.1.1", "1.2.3"]),
    ("hostname", ["a", "example.com", "a-b.c1", "x" * 63 + ".com"], ["-a.com", "a-.com", "x" * 64 + ".com", "a..b"]),
])
def test_strict_format_patterns_agree_with_the_checkers(backend, fmt, good, bad):
    compiled = served(backend, {"type": "string", "format": fmt})
    for v in good + bad:
        if fmt in CHECKER.checkers:
            assert CHECKER.conforms(v, fmt) == (v in good), v  # the oracle agrees with the table
        assert accepts(backend, compiled, json.dumps(v)) == (v in good), v


def random_pattern(rng, depth: int = 0) -> str:
    """A random regular expression over a, b and '.': groups, alternatives and every quantifier."""
    def atom(d: int) -> str:
        r = rng.random()
        if d > 2 or r < 0.4:
            return rng.choice(["a", "b", "[ab]", "\\.", "."])
        return "(" + random_pattern(rng, d + 1) + ("|" + random_pattern(rng, d + 1) if r > 0.7 else "") + ")"
    return "".join(atom(depth) + rng.choice(["", "", "", "?", "*", "+", "{1,2}", "{0,1}", "{2}", "{2,}"])
                   for _ in range(rng.randint(1, 3)))


def _loops_on_empty(pattern: str) -> bool:
    """Whether `pattern` repeats, without bound, something that can match nothing, inside another unbounded
    repeat (`((b*)+a)+`): Python's backtracking `re` can take exponential time there (one drawn pattern
    took it 38 s on five-character strings), where xgrammar's automaton does not care."""
    from re import _constants as C, _parser as P

    def nullable(items: Any) -> bool:
        for op, av in items:
            if op in (C.MAX_REPEAT, C.MIN_REPEAT):
                if av[0] > 0 and not nullable(av[2]):
                    return False
            elif op == C.SUBPATTERN:
                if not nullable(av[-1]):
                    return False
            elif op == C.BRANCH:
                if not any(nullable(b) for b in av[1]):
                    return False
            elif op != C.AT:
                return False
        return True

    def loops(items: Any, inside: bool) -> bool:
        for op, av in items:
            if op in (C.MAX_REPEAT, C.MIN_REPEAT):
                unbounded = av[1] == C.MAXREPEAT
                if (unbounded and inside and nullable(av[2])) or loops(av[2], inside or unbounded):
                    return True
            elif op == C.SUBPATTERN and loops(av[-1], inside):
                return True
            elif op == C.BRANCH and any(loops(b, inside) for b in av[1]):
                return True
        return False

    return loops(P.parse(pattern), False)


def test_served_patterns_match_exactly_what_python_re_matches(backend):
    """Random patterns, served (server.structured.xgrammar_pattern's rewrite), against `re.fullmatch` on
    every string of up to four characters of a, b and '.'. Before the rewrite 10 of 150 such patterns
    differed (an optional group with a repetition inside: `^x(ab+)?Z$` took "xbZ"). Drawn patterns on which
    `re` could backtrack for minutes (`_loops_on_empty`) are drawn again; loops on empty are written out
    below instead (an unbounded repeat of what can match nothing), small enough for `re`."""
    import itertools
    import re

    rng = random.Random(1)
    strings = [""] + ["".join(t) for n in range(1, 5) for t in itertools.product("ab.", repeat=n)]
    drawn: list[str] = []
    while len(drawn) < 80:
        if not _loops_on_empty(p := random_pattern(rng)):
            drawn.append(p)
    cases = ["x(ab+)?Z", "x(a[0-9]{1,3})?Z", "[)](b)?c", "\\((x)?\\)", "x(b*)+Z", "(a|b?)*\\.", "((a*)b?)+",
             "(a*)*b{2}", "((a?)(b*))+\\.?"] + drawn
    for p in cases:
        compiled = served(backend, {"type": "string", "pattern": f"^{p}$"})
        extra = ["xZ", "xbZ", "xabbZ", "x12Z", "xa12Z", ")c", "bc", ")bc", "()", "(x)", "x"]
        for text in strings + extra:
            assert accepts(backend, compiled, json.dumps(text)) == bool(re.fullmatch(p, text)), (p, text)


def test_repetition_counts_above_128_are_kept(backend):
    """xgrammar 0.2.9 lost a repetition count above 128 after another repetition in a JSON Schema pattern
    (`^[ae]*x{1,129}$` wrote "xa", with finish_reason stop: a helper found it); the served pattern writes one
    item of it first. Checked against `re.fullmatch` around each bound, the rest drawn at random."""
    import re

    rng = random.Random()
    lo = rng.randint(129, 140)
    cases = [("[ae]*x{1,129}", 1, 129), (f"[ae]+x{{{lo},{lo + 170}}}", lo, lo + 170), ("e?(ax){0,200}", 0, 200),
             (f"[ae]*x{{{lo},}}", lo, lo + 60), ("a*x{129}", 129, 129), ("[ae]*x{200}", 200, 200),
             ("e?x{1,1000}", 1, 1000)]  # (pieces of 128 each took a {1,1000} past the compile limit: a reviewer)
    for p, low, high in cases:
        compiled = served(backend, {"type": "string", "pattern": f"^{p}$"})
        counts = {0, 1, low - 1, low, low + 1, high - 1, high, high + 1, 128, 129, rng.randint(low, high)}
        texts = []
        for m in (c for c in counts if c >= 0):
            for head in ("", "a", "ea"):
                unit = "ax" if "(ax)" in p else "x"
                texts += [head + unit * m, head + unit * m + "a", head + unit * (m // 2) + "a" + unit * (m - m // 2)]
        for text in texts:
            assert accepts(backend, compiled, json.dumps(text)) == bool(re.fullmatch(p, text)), (p, len(text), text[:8])


ASCII = [chr(c) for c in range(1, 128)]  # control characters, '"' and '\\' too: what a JSON string must escape


@pytest.fixture(scope="module")
def ascii_backend():
    from tokenizers import AddedToken, Tokenizer, models

    vocab = {c: i for i, c in enumerate(ASCII)} | {"</s>": len(ASCII)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    b = GrammarBackend(tok, len(vocab), [len(ASCII)])
    yield b
    b.shutdown()


def ascii_accepts(backend: GrammarBackend, compiled, text: str) -> bool:
    g = backend.grammar(compiled)
    return all(g.accept(ASCII.index(ch)) for ch in text) and g.accept(len(ASCII)) and g.terminated


def random_json_pattern(rng, depth: int = 0) -> str:
    """A random pattern of literals and classes over characters a JSON string escapes and ones it does not."""
    def atom(d: int) -> str:
        r = rng.random()
        if d > 1 or r < 0.5:
            return rng.choice(["a", '"', "\\\\", "\\n", "\\t", "\\x01", "-", '["a]', "[\\\\\\n]", "[\\x00-#]",
                               "[ -~]", "\\s", "[\\sa]", "\\x5c", "\\u0022", "[a-]"])
        return "(" + random_json_pattern(rng, d + 1) + ("|" + random_json_pattern(rng, d + 1) if r > 0.75 else "") + ")"
    return "".join(atom(depth) + rng.choice(["", "", "?", "*", "+", "{1,2}"]) for _ in range(rng.randint(1, 3)))


def test_patterns_with_characters_json_escapes_write_valid_json(ascii_backend):
    """xgrammar wrote a pattern's literal `"`, `\\` and control characters raw (`^a"b$` gave the broken
    `"a"b"`) and left them out elsewhere; now they are never written: every string of up to three
    characters of a, '"', '\\', newline, tab, \\x01 and '-' is taken (as JSON text) exactly when Python's
    `re` matches it and it has none of them, and a pattern that leaves nothing is a 400 naming it.
    Sampled documents of patterns with `.`, classes and negations parse and match."""
    import itertools
    import re

    rng = random.Random(7)
    alphabet = 'a"\\\n\t\x01-'
    strings = [""] + ["".join(t) for n in range(1, 4) for t in itertools.product(alphabet, repeat=n)]
    fixed = ['a"b', '"[a-z]{2,5}"', "a\\\\b", "\\x5c", "\\n", '["a]+', "\\s+", "(a|\\\\)?-", '"?a"?', '(a"|-)+']
    refused = 0
    for p in fixed + [random_json_pattern(rng) for _ in range(60)]:
        want = [t for t in strings if re.fullmatch(p, t) and all(c == "a" or c == "-" for c in t)]
        schema = {"type": "string", "pattern": f"^{p}$"}
        try:
            compiled = served(ascii_backend, schema)
        except ParamError as e:
            refused += 1
            assert not want and "pattern" in str(e) and "constrained decoding" in str(e), (p, e)
            continue
        for text in strings:
            assert ascii_accepts(ascii_backend, compiled, json.dumps(text)) == (text in want), (p, text)
        for raw in ('"a"b"', '"a\\"', '"\n"', '"\x01"'):  # broken JSON
            assert not ascii_accepts(ascii_backend, compiled, raw), (p, raw)
    assert refused >= 3
    for p in ["^.{1,3}$", "^[^,]+$", "^\\W\\S$", "^(.|\\\\)+$", '^"?[^"]*"?$', "^[ -~]{2}$", "^[\\x00-#]+$"]:
        compiled, n = served(ascii_backend, {"type": "string", "pattern": p}), 0
        g_rng = random.Random(p)
        for _ in range(60):
            doc = _ascii_sample(ascii_backend, compiled, g_rng)
            if doc is not None:
                n += 1
                assert re.fullmatch(p, json.loads(doc)), (p, doc)
        assert n >= 20, p


def _ascii_sample(backend: GrammarBackend, compiled, rng, max_chars: int = 40) -> str | None:
    g, out = backend.grammar(compiled), []
    mask = xgr.allocate_token_bitmask(1, len(ASCII) + 1)
    for _ in range(max_chars):
        g.fill(mask, 0)
        words = mask[0].numpy().view("uint32")
        allowed = [i for i in range(len(ASCII) + 1) if (words[i // 32] >> (i % 32)) & 1]
        if len(ASCII) in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return "".join(out)
        pick = rng.choice([i for i in allowed if i != len(ASCII)])
        assert g.accept(pick)
        out.append(ASCII[pick])
    return None


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "string", "enum": [1, "a", None]}, ['"a"'], ["1", "null"]),  # xgrammar wrote any enum value
    ({"type": "integer", "enum": ["x", 3]}, ["3"], ['"x"']),
    ({"type": ["string", "null"], "enum": ["a", None, 3]}, ['"a"', "null"], ["3"]),
    ({"type": "integer", "minimum": 0.5, "maximum": 2.5}, ["1", "2"], ["0", "3"]),  # was a 400
    ({"type": "integer", "exclusiveMinimum": 0.5, "exclusiveMaximum": 2.0}, ["1"], ["0", "2"]),
    ({"type": "object", "properties": {}}, ["{}"], ['{"a": 1}']),  # a tool without parameters: only {}
])
def test_schemas_are_served_as_the_values_they_admit(backend, schema, good, bad):
    validator = jsonschema.Draft202012Validator(schema)
    compiled = served(backend, schema)
    for doc in good + bad:  # what is served is valid (an object listing its properties is also closed: narrower)
        assert validator.is_valid(json.loads(doc)) == (doc in good) or schema.get("type") == "object", doc
        assert accepts(backend, compiled, doc) == (doc in good), doc


# Keywords beside a composition, or without a `type`: xgrammar dropped them, and each `bad` document here was
# one a model wrote, finish_reason "stop" (JSON Schema applies them together with the composition)
COMPOSED_CASES = [
    ({"$defs": {"n": {"type": "integer"}}, "type": "object", "required": ["x"], "additionalProperties": False,
      "properties": {"x": {"$ref": "#/$defs/n", "minimum": 100, "maximum": 101}}}, ['{"x": 100}'], ['{"x": 3}']),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "format": "date"}, ['"2024-01-02"'], ['"hello"']),
    ({"$defs": {"a": {"type": "array", "items": {"type": "integer"}}}, "$ref": "#/$defs/a", "maxItems": 1},
     ["[1]"], ["[1, 2]", '["a"]']),
    ({"$defs": {"tree": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}},
      "$ref": "#/$defs/tree", "properties": {"v": {"maximum": 3}}},  # the root only: its children stay the tree
     ['{"v": 1, "kids": [{"v": 9}]}'], ['{"v": 9}']),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "maximum": 5}, ["3", "null"], ["1902210703"]),
    ({"type": "integer", "anyOf": [{"minimum": 100, "maximum": 101}, {"minimum": 200, "maximum": 201}]},
     ["100", "201"], ['"hi"', "150"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "additionalProperties": False, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
     ['{"a": 1}', '{"b": "x"}'], ['{"a": "To Summarize"}', "{}"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "allOf": [{"properties": {"a": {"maximum": 3}}}]}, ['{"a": 3}'], ['{"a": 70}', "{}"]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}, ['{"a": 1, "b": "x"}'], ['{"a": 1}']),
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}]},
     ['{"kind": "a"}', '{"kind": "b"}'], ['{"kind": "c"}', "{}"]),
    ({"maxLength": 2}, ['"ab"'], ['"Hello World"']),  # a schema without type: the kind its keywords constrain
    ({"pattern": "^z+$"}, ['"zz"'], ['"Hello"']),
    ({"format": "date"}, ['"2024-02-29"'], ['"hi"']),
    ({"type": "object", "required": ["a", "b"], "properties": {"a": {"maximum": 5}, "b": {"minLength": 3}}},
     ['{"a": 5, "b": "abc"}'], ['{"a": 700, "b": "abc"}', '{"a": 1, "b": "ab"}']),
    ({"type": "object", "required": ["a"], "properties": {"a": {"exclusiveMinimum": 1000}}}, ['{"a": 1001}'],
     ['{"a": 7}']),
    ({"minimum": 1, "maxLength": 1}, ["1", '"a"'], ["0", '"ab"']),  # two kinds: either, each constrained
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, ['"a"'], ['"bb"']),  # enums were written whole
    ({"type": ["integer", "number"], "minimum": 2.5, "maximum": 3.5}, ["3", "2.75"], ["4"]),  # was a 400
    ({"type": "array", "uniqueItems": False, "items": {"type": "integer"}}, ["[1, 1]"], ['["a"]']),  # was a 400
    ({"type": "object", "properties": {"a": False, "b": {"type": "integer"}}, "additionalProperties": False},
     ['{"b": 1}'], ['{"a": 1}']),  # was a 400
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "minItems": 2, "maxItems": 2,
      "items": [{"type": "string"}, {"type": "integer"}]}, ['["a", 1]'], ['[1, "a"]']),  # zod's tuples; was a 400
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
      "items": [{"type": "string"}], "additionalItems": {"type": "integer"}}, ['["a", 1, 2]'], ['["a", "b"]']),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 0,
      "exclusiveMinimum": True, "maximum": 3}, ["1", "3"], ["0"]),
    ({"$defs": {"a b": {"type": "integer"}}, "$ref": "#/$defs/a%20b"}, ["1"], ['"x"']),  # an escaped pointer
    # a review's fuzzing of the rewrite: each was a 500, output breaking the schema, or a valid schema refused
    ({"anyOf": [{"type": "integer"}], "oneOf": [{"minimum": 1}]}, ["1"], ["0"]),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "anyOf": [{"type": "string"}, {"minimum": 5}]},
     ["5"], ["4", '"x"']),
    ({"type": "object", "required": ["b"], "properties": {  # a pointer into a branch the rewrite drops around
        "a": {"anyOf": [False, {"type": "string"}, {"type": "integer"}]}, "b": {"$ref": "#/properties/a/anyOf/1"}}},
     ['{"b": "x"}'], ['{"b": 1}']),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["u"], "properties": {
        "t": {"type": "array", "items": [{"type": "string"}]}, "u": {"$ref": "#/properties/t/items/0"}}},
     ['{"u": "x"}'], ['{"u": 1}']),
    ({"components": {"schemas": {"Pet": {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}}},
      "$ref": "#/components/schemas/Pet"}, ['{"n": "x"}'], ["{}"]),  # OpenAPI's
    ({"const": {"items": [1, 2]}}, ['{"items":[1,2]}'], ['{"prefixItems":[1,2]}']),  # data, not a draft-07 tuple
    ({"type": "object", "properties": {"additionalItems": {"type": "integer"}}, "required": ["additionalItems"]},
     ['{"additionalItems": 1}'], ['{"additionalItems": true}']),
    ({"anyOf": [{"type": "string", "minLength": 5}, {"type": "integer"}], "maxLength": 3}, ["1"], ['"abcdef"']),
    ({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "integer"}], "items": {"type": "integer"}},
     ["[]", "3"], ['["a"]', "[1]"]),
    ({"enum": [1], "allOf": [{"enum": [1.0]}]}, ["1"], ["2"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^z": {"type": "integer"}}},
     ['{"a": 1}'], ['{"zz": "s"}']),  # (beside properties xgrammar writes no key by pattern: a narrowing)
    ({"type": "object", "propertyNames": {"pattern": "^[ab]$"}, "additionalProperties": False}, ["{}"], ['{"a": 6}']),
    ({"$defs": {"N": {"pattern": "^a"}}, "type": "object", "properties": {"a": {}, "b": {}},
      "propertyNames": {"$ref": "#/$defs/N"}, "additionalProperties": False}, ['{"a": 1}'], ['{"b": 1}']),
    ({"$defs": {"I": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/I"}},
      "enum": [{"x": "str"}, {"x": 1}]}, ['{"x":1}'], ['{"x":"str"}']),
    ({"format": "int32", "items": {"type": "integer"}}, ["12", "[1]"], ['["a"]']),
    # recursive references with keywords beside them (a 500, or refused), impossible branches left out (refused)
    ({"$defs": {"A": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/A"}}, {"type": "integer"}]}},
      "type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/A", "maximum": 3}}},
     ['{"x": 3}', '{"x": [9]}'], ['{"x": 4}']),
    ({"$defs": {"N": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/N", "maxProperties": 1}}}}, "$ref": "#/$defs/N"},
     ['{"v": 1, "next": {"v": 2}}'], ['{"v": 1, "next": {"v": 2, "next": {"v": 3}}}']),
    ({"enum": ["a", "b"], "anyOf": [{"type": "string"}, {"type": "integer"}]}, ['"a"'], ['"c"']),
    # a reference with keywords beside it inside allOf or a composed anyOf: its entry was looked for in the
    # client's schema ("the $ref '#/$defs/composed0' points at nothing")
    ({"$defs": {"P": {"type": "object"}}, "allOf": [{"$ref": "#/$defs/P", "required": ["x"]}]},
     ['{"x": 1}'], ["{}"]),
    ({"$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}}}}, "type": "object",
      "oneOf": [{"$ref": "#/$defs/A", "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
     ['{"k": "a"}', '{"k": "b"}'], ["{}", '{"k": "c"}']),
    # up to draft-07 a $ref ignores the keywords beside it (zod declares draft-07)
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"n": {"type": "integer"}},
      "$ref": "#/definitions/n", "maximum": 3}, ["3", "9"], ['"x"']),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 5}], "maximum": 3}, ['"x"'], ["5"]),
    ({"anyOf": [{"oneOf": [{"type": "boolean"}], "const": None}, {"type": "boolean"}]}, ["true"], ["null"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "patternProperties": {"^z": {"type": "string"}}},
     ['{"z": "s"}'], ['{"z": 1}']),  # (keys matching no pattern are not written: a narrowing)
    # an item nothing satisfies ends the array before it (the compiler refused `false` in prefixItems)
    ({"type": "array", "prefixItems": [{"type": "integer"}, False], "items": {"type": "string"}},
     ["[]", "[1]"], ['[1, "a"]', '["a"]', "[1, 2]"]),
    ({"type": "array", "prefixItems": [True, {"type": "null"}], "maxItems": 1}, ["[]", "[1]", '["a"]'], ["[1, null]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "maxItems": 1},
     ["[]", "[1]"], ['[1, "a"]', '["a"]']),
    ({"anyOf": [{"oneOf": [False]}, {"type": "integer"}]}, ["1"], ['"a"']),  # (the compiler refused the false)
    ({"$defs": {"D0": False}, "type": "array", "items": {"$ref": "#/$defs/D0"}}, ["[]"], ["[1]", "[null]"]),
    # parts whose bounds pass each other: left out as nothing satisfies them (the compiler refused them)
    ({"anyOf": [{"type": "string", "minLength": 3, "maxLength": 1}, {"type": "integer"}]}, ["5"], ['"abc"']),
    ({"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 1}}, ["[]"], ['["a"]', '["abc"]']),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer", "minimum": 5, "maximum": 1}]},
     ["[]", "[1]"], ["[1, 1]", "[1, 5]"]),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}}, ["{}"], ['{"a": []}']),
    ({"type": "object", "additionalProperties": {"type": "integer", "minimum": 5, "maximum": 1}}, ["{}"], ['{"a": 1}']),
    # a kind of a type list nothing of that kind satisfies is left out; so are items past prefixItems none can be
    ({"type": ["object", "null"], "properties": {"c": {"type": "array", "minItems": 3, "maxItems": 1}}, "required": ["c"]},
     ["null"], ['{"c": []}', "{}"]),
    ({"type": ["array", "null"], "minItems": 2, "maxItems": 1}, ["null"], ["[]", "[1, 2]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "array", "minItems": 3, "maxItems": 1}},
     ["[]", "[1]"], ["[1, []]", '["a"]']),
    # an optional property nothing satisfies beside patterns, in an object closed to other keys (a 400 said it was open)
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}, "v": {"type": "integer"}},
      "patternProperties": {"^b": {"type": "integer"}}, "additionalProperties": False},
     ['{"v": 1}', "{}"], ['{"a": "x"}', '{"v": "x"}']),  # (a key by pattern is not written beside properties)
    # a pattern that only restates a declared key leaves the object as open as it was
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^a$": {}},
      "additionalProperties": {"type": "string"}}, ['{"a": 1}', '{"b": "x"}'], ['{"b": 1}', '{"a": "x"}']),
    # an optional property only an endless value satisfies, in an object open to other keys: served as it was
    # (false there would be refused: the grammar could write it as another key)
    ({"type": "object", "properties": {"child": {"$ref": "#/$defs/inf"}, "v": {"type": "integer"}},
      "additionalProperties": True, "$defs": {"inf": {"type": "object", "properties": {"n": {"$ref": "#/$defs/inf"}},
                                                        "required": ["n"]}}}, ['{"v": 1}', '{"w": true}'], ['{"v": "x"}']),
    # a root folded to true beside definitions made for references with keywords (a 500)
    ({"$defs": {"D0": {"$ref": "#", "maxItems": 1}}, "allOf": [True]}, ["1", '"a"', "[1, 2]"], []),
    # a pattern whose keys are forbidden (the compiler refused `false` there); other keys too (a narrowing)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^z": False},
      "additionalProperties": {"type": "integer"}}, ["{}", '{"a": 1}'], ['{"z": 1}', '{"a": "x"}']),
]


@pytest.mark.parametrize("schema,good,bad", COMPOSED_CASES)
def test_keywords_beside_compositions_and_without_a_type_are_enforced(backend, schema, good, bad):
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    compiled = served(backend, schema)
    for doc in good + bad:
        assert validator.is_valid(json.loads(doc)) == (doc in good), doc  # the oracle
        assert accepts(backend, compiled, doc) == (doc in good), doc


@pytest.mark.parametrize("schema,needle", [
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "type": "string"}, "no value has type"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "type": "string"}, "nothing satisfies"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "'pattern' is set differently"),
    ({"allOf": [{"const": 1}, {"const": 2}]}, "two different consts"),
    ({"type": "object", "required": ["a"], "additionalProperties": False, "allOf": [{"properties": {"b": {}}}]},
     "the required key 'a'"),
    ({"type": "string", "enum": ["ab", "cd"], "maxLength": 1}, "no value of enum"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "required key 'a' has the schema false"),
    ({"type": "object", "properties": {"a": False}, "additionalProperties": True}, "forbidden \\(false\\)"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#x"}, "anchor"),
    ({"$defs": {"s": {"type": "string", "format": "date"}}, "$ref": "#/$defs/s", "maxLength": 4}, "maxLength together"),
    ({"allOf": [{"type": "object", "additionalProperties": {"type": "string"}},
                {"type": "object", "properties": {"y": {"type": "integer"}}}]}, "forbidden \\(false\\)"),
    ({"allOf": [{"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
                {"type": "object", "properties": {"y": {"type": "integer"}}, "additionalProperties": False}]},
     "cannot be combined"),
    ({"enum": ["a", True, 2.5], "const": 1}, "not in the enum"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "oneOf": [{"type": "string"}, {"type": "boolean"}]},
     "nothing satisfies"),
    ({"$defs": {"a": {"$ref": "#/$defs/b", "minimum": 1}, "b": {"$ref": "#/$defs/a", "maximum": 5}},
      "$ref": "#/$defs/a"}, "leads back to itself"),
])
def test_compositions_that_cannot_be_combined_are_refused(schema, needle):
    with pytest.raises(ParamError, match=needle) as e:
        json_schema_output(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format"


_LOOP = {"type": "object", "properties": {"n": {"$ref": "#/$defs/L"}}, "required": ["n"]}  # no finite value


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}, "next": {"$ref": "#/$defs/L"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#/$defs/L"}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/L"}], "minItems": 1},
    {"type": ["object", "null"], "properties": {"n": {"$ref": "#/$defs/L"}}, "required": ["n"]},
    {"anyOf": [{"$ref": "#/$defs/L"}, {"type": "integer"}]},
    {"type": "object", "additionalProperties": {"$ref": "#/$defs/L"}},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
                                    "x": {"$ref": "#/$defs/L"}},
     "required": ["kids"]},
    # through a required key given by additionalProperties, the keys minProperties asks for, a pattern's keys
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/X"}},
     "$defs": {"X": {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#/$defs/X"}}}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "n": {"$ref": "#/$defs/X"}},
     "$defs": {"X": {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}, "additionalProperties": False,
                     "minProperties": 1}}},
    {"type": "object", "patternProperties": {"^x": {"$ref": "#/$defs/L"}}, "additionalProperties": False},
])
def test_recursions_that_never_end_are_left_out_of_what_the_model_may_start(backend, schema):
    """The grammar of a part no finite value satisfies (a required property leading back into itself) let
    the model start writing it and never finish: the reply was cut at max_tokens, not JSON. Every document
    of the served grammar now ends, and satisfies the schema."""
    schema = {**schema, "$defs": {"L": _LOOP, **schema.get("$defs", {})}}
    validator = jsonschema.Draft202012Validator(schema)
    compiled = served(backend, schema)
    rng = random.Random(7)
    for _ in range(30):
        doc = sample(backend, compiled, rng, max_chars=400)
        assert doc is not None, "a document that did not end"
        assert validator.is_valid(json.loads(doc)), doc


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}]},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "additionalProperties": False, "minProperties": 1},
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                                    "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}},
])
def test_a_schema_only_an_endless_value_satisfies_is_a_400(schema):
    with pytest.raises(ParamError, match="no finite JSON value matches") as e:
        json_schema_output(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format"


@pytest.mark.parametrize("schema", [{"type": "string", "const": 5}, {"type": "boolean", "enum": [0, "no"]}])
def test_an_enum_or_const_none_of_whose_values_has_the_type_is_a_400(backend, schema):
    with pytest.raises(ParamError, match="has type"):
        served(backend, schema)


def test_annotations_and_unknown_keywords_are_ignored_integer_sizes_are_bounds(backend):
    """JSON Schema ignores keywords it does not define (OpenAPI's `x-*`) and annotations; OpenAPI's int32 and
    int64 are enforced as their ranges, other unknown formats are annotations."""
    schema = {"type": "object", "$anchor": "top", "contentMediaType": "application/json", "x-tags": ["a"],
              "properties": {"n": {"type": "integer", "format": "int32", "x-order": 1},
                             "big": {"type": "integer", "format": "int64"},
                             "f": {"type": "number", "format": "float", "contentEncoding": "base64"}},
              "required": ["n", "big", "f"]}
    compiled = served(backend, schema)
    assert accepts(backend, compiled, '{"n": -2147483648, "big": 9223372036854775807, "f": 1.5}')
    assert not accepts(backend, compiled, '{"n": 2147483648, "big": 1, "f": 1}')
    assert not accepts(backend, compiled, '{"n": 1, "big": 9223372036854775808, "f": 1}')
    for keyword in ("uniqueItems", "not", "if", "multipleOf", "dependentRequired", "unevaluatedProperties"):
        value = {"uniqueItems": True, "not": {}, "if": {}, "dependentRequired": {"a": ["b"]},
                 "unevaluatedProperties": False}.get(keyword, 2)
        with pytest.raises(ParamError, match=keyword):
            json_schema_output({"type": "object", keyword: value}, "response_format.json_schema.schema")
    with pytest.raises(ParamError, match="uri-template"):
        json_schema_output({"type": "string", "format": "uri-template"}, "x")
    with pytest.raises(ParamError, match="pattern together with format"):
        json_schema_output({"type": "string", "format": "ipv4", "pattern": "^1"}, "x")


# schema, documents it must take, documents it must refuse (each checked against jsonschema first)
OBJECT_CASES = [
    # a required key not in properties: xgrammar alone let {} through
    ({"type": "object", "required": ["z"]}, ['{"z": 1}'], ["{}"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
      "additionalProperties": {"type": "string"}}, ['{"z": "s"}', '{"a": 1, "z": "s"}'], ["{}", '{"a": 1}', '{"z": 1}']),
    ({"type": "object", "patternProperties": {"^tag$": {"type": "integer"}}, "required": ["tag"]}, ['{"tag": 1}'],
     ["{}", '{"tag": "s"}', '{"tag": 1, "tag": 2}']),
    # extra keys never repeat a declared one (xgrammar's additionalProperties rule excludes them)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": {"type": "string"}}, ['{"a": 1, "b": "x"}'], ['{"a": 1, "a": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"],
      "propertyNames": {"pattern": "^[ab]$"}, "additionalProperties": False}, ['{"a": 1, "b": "x"}'], ['{"a": 1, "a": 2}']),
    # a declared key that breaks propertyNames can never be written
    ({"type": "object", "properties": {"a": {"type": "integer"}, "bb": {"type": "integer"}},
      "propertyNames": {"maxLength": 1}, "additionalProperties": False}, ['{"a": 1}', "{}"], ['{"a": 1, "bb": 2}']),
]


@pytest.mark.parametrize("schema,good,bad", OBJECT_CASES)
def test_served_objects_keep_required_keys_and_write_no_key_twice(backend, schema, good, bad):
    validator = jsonschema.Draft202012Validator(schema)
    compiled = served(backend, schema)
    for doc in good:
        assert validator.is_valid(json.loads(doc)) and accepts(backend, compiled, doc), doc
    for doc in bad:  # (a repeated key parses to its last value: the oracle sees that object)
        assert accepts(backend, compiled, doc) is False, doc
        if doc.count('"a"') < 2 and doc.count('"tag"') < 2:
            assert not validator.is_valid(json.loads(doc)), doc


@pytest.mark.parametrize("schema,needle", [
    ({"type": "object", "properties": {}, "required": ["z"], "additionalProperties": False}, "no object satisfies"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "propertyNames": {"pattern": "^a$"}},
     "propertyNames beside properties"),
    ({"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x": {"type": "integer"}}},
     "matches the patternProperties"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "required": ["xy"]},
     "matches the patternProperties"),  # (it could be written twice, however alike its two schemas)
    ({"type": "object", "properties": {"tag": {"type": "string"}}, "patternProperties": {"^tag$": {"maxLength": 3}}},
     "matches the patternProperties"),
    ({"type": "object", "required": ["a"], "propertyNames": {"pattern": "^b"}}, "breaks propertyNames"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": False}, "minProperties 2"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}, "maxProperties 1"),
    # keys beyond the required ones counted towards minProperties: xgrammar wrote '{"n": 10, "n": 11, "n": 21}'
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}, "minProperties 3 at /"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "patternProperties": {"^x": {}},
      "minProperties": 2}, "cannot keep distinct"),
    ({"type": "object", "propertyNames": {"enum": ["p", "q"]}, "minProperties": 2}, "cannot keep distinct"),
])
def test_objects_no_value_satisfies_or_xgrammar_cannot_keep_are_refused(schema, needle):
    with pytest.raises(ParamError, match=needle) as e:
        json_schema_output(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format"


@pytest.mark.parametrize("bounds", [
    {"minimum": 1e-10, "maximum": 3e-10}, {"minimum": 1e-8, "maximum": 2e-8},
    {"exclusiveMinimum": 0.5, "exclusiveMaximum": 0.5000005}, {"exclusiveMinimum": 0.5, "maximum": 0.5000009},
])
def test_number_ranges_with_no_short_number_are_refused(bounds):
    """xgrammar writes ranges to 6 decimals: a narrower one compiled to an empty rule ('{"x": }', "stop")."""
    schema = {"type": "object", "properties": {"x": {"type": "number", **bounds}}, "required": ["x"]}
    with pytest.raises(ParamError, match="the number range at /properties/x holds no number of at most 6 decimals"):
        json_schema_output(schema, "response_format.json_schema.schema")


def test_number_ranges_and_min_properties_that_can_be_kept_are_served(backend):
    for schema, good, bad in [
        ({"type": "number", "minimum": 0.5, "maximum": 0.500001}, "0.500001", "0.6"),
        ({"type": "number", "exclusiveMinimum": 0.5, "maximum": 0.500001}, "0.500001", "0.5"),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "minProperties": 2},
         '{"a": 1, "b": 2}', '{"a": 1}'),
    ]:
        out = json_schema_output(schema, "response_format.json_schema.schema")
        g = backend.compile("json_schema", out.spec, "response_format")
        assert accepts(backend, g, good) and not accepts(backend, g, bad), (schema, good, bad)


def test_regex_grammar_and_json_object(backend):
    rx = backend.compile("regex", r"(yes|no)-[0-9]{2}", "regex")
    assert accepts(backend, rx, "yes-12") and not accepts(backend, rx, "maybe-12") and not accepts(backend, rx, "no-1")
    ebnf = backend.compile("grammar", 'root ::= "(" [a-z]+ ")"', "ebnf")
    assert accepts(backend, ebnf, "(abc)") and not accepts(backend, ebnf, "(ab1)")
    obj = backend.compile("json_object", "", "response_format")
    assert accepts(backend, obj, '{"k": [1, {"x": null}]}') and not accepts(backend, obj, "[1]")


@pytest.mark.parametrize("kind,spec", [("json_schema", '{"type": "strin"}'), ("grammar", "root ::= undefined_rule"),
                                       ("regex", "(unclosed")])
def test_bad_specs_raise_grammar_error_naming_the_param(backend, kind, spec):
    with pytest.raises(GrammarError) as e:
        backend.compile(kind, spec, "response_format")
    assert e.value.param == "response_format" and "response_format" in e.value.message and "[" not in e.value.message[:1]


@pytest.mark.parametrize("spec", ["root ::= root", 'root ::= a\na ::= a "x"', 'root ::= x | y\nx ::= y\ny ::= x'])
def test_a_grammar_that_accepts_no_text_is_refused(backend, spec):
    """xgrammar compiles a grammar whose rules only refer to themselves; a request under it had no token to
    start with, and ended at once as a normal stop, with an ERROR logged (a helper found it)."""
    with pytest.raises(GrammarError) as e:
        backend.compile("grammar", spec, "guided_grammar")
    assert e.value.param == "guided_grammar" and "accepts no text" in e.value.message
    with pytest.raises(GrammarError):  # refused again from what it remembers
        backend.compile("grammar", spec, "guided_grammar")
    ok = backend.compile("grammar", 'root ::= "x" | root "y"', "guided_grammar")  # left recursion that ends
    assert accepts(backend, ok, "xyy") and not accepts(backend, ok, "y")


def test_compile_runs_off_the_calling_thread(backend):
    fut = backend.submit("regex", "[a-c]{3}", "regex")
    assert accepts(backend, fut.result(timeout=30), "abc")


def slow_schema(bound: int) -> str:
    """A small JSON Schema xgrammar takes long to compile: a pattern's bounded repetition costs about
    the cube of its bound (here {1,13000} ~9 s, {1,26000} ~100 s on the 2-core development machine)."""
    return json.dumps({"type": "string", "pattern": f"^[a-z]{{1,{bound}}}$"})


@pytest.fixture
def limited(backend):
    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP], timeout_s=3)
    yield b
    b.shutdown()


def wait_started(b: GrammarBackend, n: int, not_pid: int | None = None) -> int:
    """Until a compiler process (not `not_pid`) has begun `n` compiles (as it says); its pid."""
    for _ in range(1200):
        proc = b._proc
        if (proc is not None and proc.proc.pid != not_pid
                and sum(j.started is not None for j in proc.jobs.values()) >= n):
            return proc.proc.pid
        threading.Event().wait(0.05)
    raise AssertionError("the compiles did not start")


def test_slow_compiles_hold_up_no_other_and_end_at_the_time_limit(limited):
    """Specs that would compile for minutes: a cached and a new spec are served beside them, each slow
    one is refused once it has compiled for the limit (3 s here), naming its parameter, and a new
    compiler process serves what comes next (before, a compile ran to its end on an engine thread)."""
    import executor.grammar as grammar_mod

    limited.compile("regex", "[ab]+", "regex")  # cached from here on; the compiler process is up
    first = limited.compiler_pid
    slow = [limited.submit("json_schema", slow_schema(26000 + i), "response_format")
            for i in range(grammar_mod._COMPILE_WORKERS - 1)]
    assert accepts(limited, limited.submit("regex", "[ab]+", "regex").result(timeout=1), "ab")
    assert accepts(limited, limited.submit("regex", "c{2}", "regex").result(timeout=60), "cc")
    for f in slow:
        with pytest.raises(GrammarError) as e:
            f.result(timeout=120)
        assert e.value.param == "response_format" and "took longer than 3 s to compile" in e.value.message
    assert accepts(limited, limited.compile("regex", "d+", "regex"), "ddd")
    second = limited.compiler_pid
    assert second not in (None, first)
    again = limited.submit("json_schema", slow_schema(26000), "tool_choice")  # refused once: not compiled again
    assert again.done() and limited.compiler_pid == second
    with pytest.raises(GrammarError, match="tool_choice: .*took longer than 3 s to compile"):
        again.result(timeout=0)


def test_a_compile_under_way_when_another_is_stopped_is_finished_by_the_next_process(limited):
    """The innocent compile is sent again and served; a slow spec under way with it is refused at its own
    limit, in the next process."""
    slow = limited.submit("json_schema", slow_schema(26000), "response_format")
    wait_started(limited, 1)
    threading.Event().wait(2.5)
    innocent = limited.submit("json_schema", slow_schema(3000), "response_format")  # ~1 s of compiling
    late = limited.submit("json_schema", slow_schema(26001), "response_format")
    with pytest.raises(GrammarError, match="took longer than 3 s"):
        slow.result(timeout=120)
    assert accepts(limited, innocent.result(timeout=120), '"abc"')
    with pytest.raises(GrammarError, match="took longer than 3 s"):
        late.result(timeout=120)


def test_a_dead_compiler_process_is_replaced(backend):
    """Killed from outside (the kernel's OOM killer, say) while compiling: its specs go to a new process;
    a spec under way at two such deaths is refused as the likely cause, not retried for ever."""
    import os
    import signal

    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP], timeout_s=0)
    try:
        doomed = b.submit("json_schema", slow_schema(26000), "response_format")
        pid = wait_started(b, 1)
        os.kill(pid, signal.SIGKILL)
        fine = b.submit("regex", "[xy]+", "regex")
        os.kill(wait_started(b, 1, not_pid=pid), signal.SIGKILL)
        with pytest.raises(GrammarError) as e:
            doomed.result(timeout=120)
        assert e.value.param == "response_format" and "compiler process ended twice while compiling it (the last time: signal 9" in e.value.message
        assert accepts(b, fine.result(timeout=120), "xyx")
        assert accepts(b, b.compile("regex", "z+", "regex"), "zz")
    finally:
        b.shutdown()


def test_a_spec_a_dead_process_had_not_begun_is_not_charged(backend):
    """A spec waiting in compiler processes that die before they begin it (every worker busy here; sent to
    one already dead in the test above, as a loaded machine once had it) is not why they die: it was
    charged as if under way, and two such deaths refused it though it never ran."""
    import os
    import signal

    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP], timeout_s=0)
    try:
        slow = [b.submit("json_schema", slow_schema(26000 + i), "response_format") for i in range(8)]
        pid = wait_started(b, 8)  # every worker busy
        waiting = b.submit("regex", "[xy]+", "regex")
        os.kill(pid, signal.SIGKILL)
        os.kill(wait_started(b, 8, not_pid=pid), signal.SIGKILL)  # the slow ones again, the regex waits again
        for fut in slow:
            with pytest.raises(GrammarError, match="ended twice while compiling it"):
                fut.result(timeout=120)
        assert accepts(b, waiting.result(timeout=120), "xyx")
    finally:
        b.shutdown()


def test_a_frozen_compiler_process_is_replaced(backend, monkeypatch):
    """Stopped (SIGSTOP) while idle: the next spec would wait for ever to begin. With a time limit, a spec
    that has not begun by the limit plus a grace is taken as a frozen process, which is replaced."""
    import os
    import signal

    import executor.grammar as grammar_mod

    # (the replacement too must begin the spec within the limit and grace: a process start took past 3 s on
    # a loaded 2-core machine, was taken as frozen as well, and the spec failed)
    monkeypatch.setattr(grammar_mod, "_START_GRACE_S", 6.0)
    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP], timeout_s=2)
    try:
        b.compile("regex", "a+", "regex")
        frozen = b.compiler_pid
        os.kill(frozen, signal.SIGSTOP)
        assert accepts(b, b.submit("regex", "b+", "regex").result(timeout=120), "bb")
        assert b.compiler_pid not in (None, frozen)
    finally:
        b.shutdown()


def test_a_spec_whose_requests_were_aborted_is_not_sent_again(limited):
    """Its future cancelled (the engine does so on abort), a spec under way when a neighbour outlives the
    limit is dropped with the process, not resent: aborted slow specs held the workers for good."""
    slow = limited.submit("json_schema", slow_schema(26000), "response_format")
    wait_started(limited, 1)
    gone = limited.submit("json_schema", slow_schema(26001), "response_format")
    wait_started(limited, 2)
    gone.cancel()
    with pytest.raises(GrammarError, match="took longer than 3 s"):
        slow.result(timeout=120)
    for _ in range(100):
        if not limited._by_spec:
            break
        threading.Event().wait(0.05)
    assert not limited._by_spec and limited._proc is None  # nothing resent: no new process


def test_the_compiler_process_takes_sigterm_and_an_unbounded_limit(backend):
    """It inherited the engine's ignored SIGTERM (kill -TERM did nothing); an infinite limit
    (--grammar-compile-timeout inf) was an OverflowError in the compiler thread's wait, which ended the
    backend and then the engine."""
    import os
    import signal

    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP], timeout_s=float("inf"))
    try:
        slow = b.submit("json_schema", slow_schema(26000), "response_format")
        pid = wait_started(b, 1)
        os.kill(pid, signal.SIGTERM)
        assert accepts(b, b.compile("regex", "q+", "regex"), "qq")  # a new process serves
        assert b.compiler_pid not in (None, pid)
        slow.cancel()
    finally:
        b.shutdown()


def test_a_compiler_process_that_fails_to_start_is_started_again(backend, monkeypatch):
    """Killed before it read its setup (a BrokenPipeError here), the first start failed that round's specs
    with a 503; it is tried once more."""
    import executor.grammar as grammar_mod

    real, calls = grammar_mod._CompilerProcess, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 1:
            raise BrokenPipeError("killed at start")
        return real(*a)

    monkeypatch.setattr(grammar_mod, "_CompilerProcess", flaky)
    b = GrammarBackend(backend._tokenizer, backend.vocab_size, [STOP])
    try:
        assert accepts(b, b.compile("regex", "k+", "regex"), "kk") and len(calls) == 2
    finally:
        b.shutdown()


def test_identical_specs_share_one_compile_and_the_cache(backend):
    spec = json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    futures = [backend.submit("json_schema", spec, f"p{i}") for i in range(4)]
    compiled = {id(f.result(timeout=60)) for f in futures}
    assert len(compiled) == 1
    assert id(backend.compile("json_schema", spec, "p")) in compiled
    with pytest.raises(GrammarError) as e:  # a failure names each waiter's own parameter
        [backend.submit("regex", "(open", p) for p in ("a", "b")][1].result(timeout=60)
    assert e.value.param == "b"


def test_sampler_only_picks_allowed_tokens_and_reports_masked_logprobs(backend):
    """Random logits, rows with and without a grammar, greedy and sampled: constrained rows pick only
    allowed ids, and their logprobs are those of the masked distribution (the allowed ids' probabilities
    sum to 1); the unconstrained row is untouched."""
    compiled = backend.compile("regex", "[x-z]+", "regex")
    sampler = Sampler(VOCAB)
    gen = torch.Generator().manual_seed(11)
    allowed = {CHARS.index(c) for c in "xyz"}
    for step in range(20):
        logits = torch.randn(3, VOCAB, generator=gen) * 3
        grammars = [backend.grammar(compiled), None, backend.grammar(compiled)]
        params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
                  SamplingParams(temperature=0.0, logprobs=True),
                  SamplingParams(temperature=1.3, top_p=0.9, logprobs=True, top_logprobs=3, logit_bias={0: 50.0})]
        rows = [SamplingRow(p, seed=step, step=0, prompt_ids=[1], output_ids=[], eos_token_ids=[STOP], grammar=g)
                for p, g in zip(params, grammars)]
        result = sampler(logits, rows)
        assert result.token_ids[0] in allowed and result.token_ids[2] in allowed
        assert result.token_ids[1] == int(logits[1].argmax())
        masked = torch.full_like(logits[0], float("-inf"))
        masked[list(allowed)] = logits[0, list(allowed)]
        assert result.token_ids[0] == int(masked.argmax())
        assert result.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(masked, -1)[result.token_ids[0]]), abs=1e-5)
        assert sum(torch.tensor([v for _, v in result.logprobs[0].top]).exp().tolist()) == pytest.approx(1.0, abs=1e-5)
        assert {t for t, _ in result.logprobs[2].top} <= allowed
        assert result.logprobs[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1).max()), abs=1e-5)


def test_stop_is_allowed_exactly_where_the_document_can_end(backend):
    compiled = backend.compile("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 2}),
                               "response_format")
    g = backend.grammar(compiled)
    x = torch.zeros(1, VOCAB)
    for ch in "[1":
        apply_grammar_masks(x, [g])
        assert x[0, STOP] == float("-inf")  # not yet
        assert g.accept(CHARS.index(ch))
        x.zero_()
    for ch in ", 2]":
        assert g.accept(CHARS.index(ch))
    apply_grammar_masks(x, [g])
    assert x[0, STOP] == 0.0 and (x[0, :STOP] == float("-inf")).all()  # only the end is left
    assert g.accept(STOP) and g.terminated
    assert isinstance(g, Grammar)


def test_mask_equals_xgrammars_own_kernel(backend):
    """Our CPU unpacking against xgrammar's apply_token_bitmask_inplace, rows at different states."""
    compiled = backend.compile("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5}, "b": {"enum": ["x", "yz"]}}, "required": ["a", "b"]}), "response_format")
    grammars = []
    for prefix in ('{"a": "', '{"a": "abc', '{"a": "ab", "b": "', ""):
        g = backend.grammar(compiled)
        assert all(g.accept(CHARS.index(ch)) for ch in prefix)
        grammars.append(g)
    grammars.insert(2, None)
    x = torch.randn(len(grammars), VOCAB, generator=torch.Generator().manual_seed(5))
    ours = x.clone()
    apply_grammar_masks(ours, grammars)
    theirs = x.clone()
    bitmask = xgr.allocate_token_bitmask(len(grammars), VOCAB)
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=VOCAB, indices=[i for i, g in enumerate(grammars) if g])
    assert torch.equal(ours, theirs) and torch.equal(ours[2], x[2])
    assert len({int((row > -1e30).sum()) for row in ours}) > 2  # the rows really differ


def test_a_grammar_after_a_marker_sleeps_through_the_reasoning(backend):
    """A reasoning model's constraint starts after its `</think>`: before it every token is allowed and
    accepted (the marker cut by other tokens does not count); after it the document is checked."""
    import xgrammar as xgr

    rx = backend.compile("regex", r"(yes|no)", "response_format")
    marker = [CHARS.index(c) for c in "</t>"]
    g = backend.grammar(rx, after=marker)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    mask.zero_()
    g.fill(mask, 0)
    assert (mask == -1).all() and not g.terminated  # asleep: anything goes
    for ch in "maybe </x> </t no":  # free text, a near-marker, the marker cut in two
        assert g.accept(CHARS.index(ch))
    assert not g.awake
    assert all(g.accept(t) for t in marker) and g.awake
    g.fill(mask, 0)
    assert not (mask == -1).all()  # awake: the regex's mask
    assert not g.accept(CHARS.index("m")) and all(g.accept(CHARS.index(c)) for c in "no") and g.accept(STOP)
    assert g.terminated
    plain = backend.grammar(rx)
    assert plain.awake and not plain.accept(CHARS.index("m"))


def _allowed(words: torch.Tensor) -> set[int]:
    w = words.numpy().view("uint32")
    return {i for i in range(VOCAB) if (w[i // 32] >> (i % 32)) & 1}


def _mask_now(g: Grammar) -> set[int]:
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    g.fill(mask, 0)
    return _allowed(mask[0])


@pytest.mark.parametrize("asleep", [False, True])
def test_a_draft_is_cut_where_the_grammar_refuses_it_and_each_position_gets_its_mask(backend, asleep):
    """Grammar.along (speculative drafts under a grammar): the kept start of the draft, and the mask at each
    position of its verification equal to the mask a fresh grammar has after the draft's tokens before it;
    the grammar is left where it was. A draft stops before a refused token and before the stop id that
    completes the document; asleep (a reasoning model's `after` ids), every token is allowed until they
    come, and the draft wakes the grammar only on the way."""
    compiled = backend.compile("regex", "(ab|ac)[0-9]{2};", "x")
    ids = lambda text: [CHARS.index(c) for c in text]  # noqa: E731
    after = ids("#!") if asleep else []
    lead = ids("zz#!") if asleep else []  # the thought, then its end
    make = lambda: Grammar(xgr.GrammarMatcher(compiled), after)  # noqa: E731
    for draft, kept in ((ids("ac1"), 3), (ids("ab12;"), 5), (ids("ab1x2"), 3), (ids("x"), 0),
                        (ids("ab12;") + [STOP], 5), ([STOP], 0)):
        g, g2 = make(), make()
        full = lead + draft
        before = _mask_now(g)
        got, masks = g.along(full, VOCAB)
        assert got == full[: len(lead) + kept], (draft, got)
        assert len(masks) == len(got) + 1
        assert _mask_now(g) == before  # left where it was: the same mask, and it takes the draft again
        for j, m in enumerate(masks):
            assert _allowed(m.words) == _mask_now(g2), (draft, j)
            if j < len(got):
                assert g2.accept(got[j])
        assert g.along(full, VOCAB)[0] == got
    g = make()
    for t in lead + ids("ab12;"):
        assert g.accept(t)
    assert g.accept(STOP) and g.terminated  # the stop id the draft left out is what the verification samples


def test_strict_tools_under_auto_hold_calls_and_leave_text_free(ascii_backend):
    """tool_choice "auto" with a strict tool (server.tools): a structural tag of free text in which each Hermes
    block is a call to one of the tools, the strict one's arguments held to its schema as a forced call's
    are (the same compact JSON), another's to any object; with parallel_tool_calls false, one call and the end."""
    from server.protocol import ChatCompletionRequest
    from server.tools import plan_tools

    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
    other = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}

    def plan(**kw):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw})
        return plan_tools(body, None)

    p = plan(tools=[weather, other])
    assert p.free and not p.forced and p.structured.kind == "structural_tag" and p.structured.param == "tools"
    g = ascii_backend.compile(p.structured.kind, p.structured.spec, "tools")

    def call(name: str, args: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'

    good = '{"city": "Paris", "unit": "c"}'
    for text in ("Plain text, no call.", "Let me check.\n" + call("get_weather", good) + "\nDone.",
                 call("note", '{"any": [1, {"x": null}]}') + call("get_weather", good), "a < b <tool", ""):
        assert ascii_accepts(ascii_backend, g, text), text
    for text in (call("get_time", "{}"), call("get_weather", '{"city": "Montpellier", "unit": "c"}'),
                 call("get_weather", '{"city": "Paris", "unit": "k"}'), call("get_weather", '{"city": "Paris"}'),
                 call("note", "[1]"), '<tool_call>\n{"arguments": {}, "name": "note"}\n</tool_call>'):
        assert not ascii_accepts(ascii_backend, g, text), text
    # the arguments exactly as the same schema compiled for a forced call takes them
    forced = ascii_backend.compile(*(lambda s: (s.kind, s.spec))(plan(tools=[weather], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}).structured), "tool_choice")
    for args in (good, '{"city":"Paris","unit":"c"}', '{ "city": "Paris", "unit": "c" }', '{"unit": "c", "city": "x"}',
                 '{"city": "Paris", "unit": "c", "x": 1}'):
        assert ascii_accepts(ascii_backend, g, call("get_weather", args)) == ascii_accepts(ascii_backend, forced, args)
    one = plan(tools=[weather, other], parallel_tool_calls=False)
    g1 = ascii_backend.compile(one.structured.kind, one.structured.spec, "tools")
    assert ascii_accepts(ascii_backend, g1, "Ok.\n" + call("get_weather", good))
    assert not ascii_accepts(ascii_backend, g1, call("get_weather", good) + call("note", "{}"))
    # no strict tool, or a markup with no fixed frame around the arguments: nothing is held
    assert plan(tools=[other]).structured is None
    assert plan_tools(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                            "tools": [weather]}), None, "llama3_json").structured is None
