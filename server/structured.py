"""Structured outputs at the server edge: which constraint a request asks for, and whether we can keep it.

    request --structured_output--> StructuredOutput(kind, spec, param) | None --SamplingParams--> engine
                                   (compiled there by executor.grammar; a spec that does not compile
                                    comes back as a 400 naming `param`)

Accepted spellings, at most one per request: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`); vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; SGLang's `regex`,
`ebnf` and `json_schema` (a schema as JSON text); llama.cpp server's `grammar` (GBNF) and `json_schema`
(the schema itself).

A JSON Schema is checked here, before any work: it must be a valid schema (the metaschema of its
draft, `jsonschema`), and every constraint in it must be one the grammar engine enforces. xgrammar skips
keywords it does not implement (`multipleOf`, `uniqueItems`, `not`, `if`, ...); a request asking for
one would get output that silently breaks its schema, so it is refused with a 400 naming the keyword
and where it is. Keywords JSON Schema's vocabularies do not define (`x-order`, ...) and those that only
annotate (`title`, `contentMediaType`, `$anchor`, ...) are ignored, as validators ignore them. `oneOf` is
enforced as `anyOf` (a value matching two branches is not excluded), and a `pattern` is matched as a
whole (anchored) and written without the characters JSON escapes (`xgrammar_pattern`), which only
narrows what is produced, a count past 128 written in the form xgrammar keeps (`_repeat`). `minLength` or
`maxLength` beside a `pattern` or `format` is refused: xgrammar would drop the length. Keywords beside
`$ref`, `anyOf`/`oneOf` and `allOf`, which xgrammar drops, are folded into them first, and a schema without
`type` gets the kind its keywords constrain (server.schema_compose).

The schema sent to the engine (`_engine_schema`) is still the client's, in the forms xgrammar keeps:
compositions folded (above), annotations left out, `enum` values the keywords beside them refuse dropped, strict patterns for the formats whose xgrammar rules admit invalid values, the
required keys an object does not list in `properties` listed there (xgrammar does not require them
otherwise), and every object that lists its `properties` closed to other keys unless it says otherwise
(`_object`): any output of the narrowed schema still matches the original, minus the keys a small model
would otherwise invent. An object no value satisfies (a required key that no key may be) is a 400.
"""

from __future__ import annotations

import json
import math
import re
import re._parser as _sre  # the stdlib's own regex parser (read by xgrammar_pattern)
from collections.abc import Callable
from typing import Any, NoReturn

from pydantic_core import from_json

from scheduler.sampling_params import ParamError, StructuredOutput
from server.schema_compose import (
    MISSING,
    OPEN_BY_DESIGN,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_VALUES,
    composed,
    current_draft,
    finite,
    hoisted,
    json_equal,
    name_ok,
    resolve,
    schemas,
    search,
)

# keywords the grammar engine enforces (checked one by one against xgrammar 0.2.x in the tests)
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "pattern", "minLength", "maxLength", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
# keywords of JSON Schema's vocabularies that constrain values and that the grammar engine does not
# enforce: refused. Every other keyword (`title`, `x-order`, `contentMediaType`, `$anchor`, ...) is an
# annotation, as JSON Schema treats keywords it does not know: ignored, and left out of the schema compiled.
UNENFORCED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
    "multipleOf", "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems",
    "$dynamicRef", "$recursiveRef",
})
# values of those keywords that constrain nothing: accepted (and left out of the schema compiled)
NO_OPS: dict[str, Any] = {"uniqueItems": False, "dependentRequired": {}, "dependentSchemas": {}, "dependencies": {}}
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uuid"})
# formats JSON Schema defines that are not enforced: refused. Other formats (OpenAPI's `float`, `byte`,
# `password`, ...) are annotations, except OpenAPI's integer sizes, enforced as bounds (_INT_FORMATS).
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "uri-template", "json-pointer",
                                "relative-json-pointer", "regex"})
_INT_FORMATS = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
# Formats whose xgrammar rule admits invalid values (sampled against jsonschema's format checkers in
# tests/executor/test_grammar.py): days past a month's end (2023-11-31), second 60, octets with leading
# zeros (01.2.3.4), host labels past 63 characters. Compiled as these patterns instead.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9])"
_LEAP = "([0-9][0-9](0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL63, _LABEL61 = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?", "[a-zA-Z0-9]([a-zA-Z0-9-]{0,59}[a-zA-Z0-9])?"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
    "hostname": f"^({_LABEL63}\\.){{0,3}}{_LABEL61}$",  # at most 253 characters
}
# JSON containers a schema may nest (a `properties` map and the schema in it are two). The checks below
# and the metaschema validation recurse: a few KB of deeper nesting would exhaust Python's stack and
# answer 500. OpenAI allows 10 levels of object nesting in a schema; this is several times that.
MAX_SCHEMA_DEPTH = 64


# vLLM's and SGLang's structured-output fields of chat and completions requests, by the kind each asks for
_EXTENSION_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar", "json_schema": "json",
                    "grammar": "grammar"}
EXTENSION_FIELDS = ("structured_outputs", *_EXTENSION_KINDS)


def structured_output(body: Any) -> StructuredOutput | None:
    """The request's constraint, or None; ParamError naming the field for a bad or unsupported one."""
    found: list[StructuredOutput] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object" and rf.schema_ is not None:  # llama.cpp server's form
        found.append(json_schema_output(rf.schema_, "response_format.schema"))
    elif rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", "", "response_format"))
    elif rf is not None and rf.type == "json_schema":
        found.append(json_schema_output(rf.json_schema.schema_, "response_format.json_schema.schema"))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) != 1:
            raise ParamError("structured_outputs", "structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {len(given)}")
        found.append(_vllm_style(given[0].rstrip("_"), getattr(so, given[0]), f"structured_outputs.{given[0].rstrip('_')}"))
    for field, kind in _EXTENSION_KINDS.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append(_vllm_style(kind, value, field))
    if len(found) > 1:
        raise ParamError(found[1].param.split(".")[0], "ask for one structured output at a time: "
                         f"{', '.join(f.param.split('.')[0] for f in found)} were given together")
    return found[0] if found else None


def json_schema_output(schema: Any, param: str) -> StructuredOutput:
    """A checked JSON Schema constraint (dict or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = from_json(schema)
        except ValueError as e:
            raise ParamError(_top(param), f"{param} is not valid JSON: {e}") from None
    return _output(check_json_schema(schema, param), param)


def schema_output(schema: Any, param: str) -> StructuredOutput:
    """The engine's constraint for a schema already checked (`check_json_schema`), objects closed."""
    return _output(_engine_schema(schema, param), param)


def _output(engine_schema: Any, param: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(engine_schema, ensure_ascii=False), _top(param))


def check_valid_schema(schema: Any, param: str) -> None:
    """ParamError(param) unless `schema` is a valid JSON Schema (by its metaschema: what a schema only
    shown to the model, like a tool's parameters under tool_choice auto, must be)."""
    if not isinstance(schema, (dict, bool)):
        raise ParamError(_top(param), f"{param} must be a JSON Schema object, got {type(schema).__name__}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ParamError(_top(param), f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON objects and "
                         "arrays; flatten it (use $defs and $ref for repeated parts)")
    try:
        import jsonschema

        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ParamError(_top(param), f"{param} is not a valid JSON Schema at {where}: {e.message}") from None
    _check_refs(schema, param)


def _depth(value: Any) -> int:
    """How many JSON containers deep `value` nests (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_SCHEMA_DEPTH:
            stack.extend((child, level + 1) for child in children)
    return deepest


def _check_refs(schema: Any, param: str) -> None:
    """Every local `$ref` points at a subschema, and no chain of bare references comes back to where it
    started: such a schema matches no JSON value at all, and the grammar built from it would let the
    model say nothing (an empty reply reported as finished)."""
    bare = lambda n: isinstance(n, dict) and isinstance(n.get("$ref"), str) and not (  # noqa: E731
        (set(n) & (ENFORCED | UNENFORCED)) - {"$ref", "$defs", "definitions"})
    for path, node in schemas(schema):
        ref, seen, target = node.get("$ref"), {id(node)}, node
        if not isinstance(ref, str) or not ref.startswith("#"):
            continue
        while True:
            r = target["$ref"]
            if r != "#" and not r.startswith("#/"):
                raise ParamError(_top(param), f"{param}: the $ref '{r}' (at {path or '/'}) names an anchor, which is not "
                                 "supported; refer to the subschema by its JSON pointer ('#/$defs/name')")
            target = resolve(schema, r)
            if target is MISSING:
                raise ParamError(_top(param), f"{param}: the $ref '{r}' (at {path or '/'}) points at nothing in the schema")
            if id(target) in seen:
                raise ParamError(_top(param), f"{param}: the $ref at {path or '/'} leads back to itself through "
                                 "references alone, so no JSON value matches; give the schema some structure")
            seen.add(id(target))
            if not bare(target) or not str(target["$ref"]).startswith("#"):
                break


def check_json_schema(schema: Any, param: str) -> Any:
    """ParamError(param) unless `schema` is a valid JSON Schema whose every constraint we enforce; else the
    schema xgrammar is to compile for it (`_engine_schema`)."""
    check_valid_schema(schema, param)
    for path, node in schemas(current_draft(schema)):
        where = path or "/"
        for key, value in node.items():
            if key in UNENFORCED and not (key in NO_OPS and value == NO_OPS[key]):
                raise ParamError(_top(param), f"{param}: the keyword '{key}' (at {where}) is not supported "
                                 "by constrained decoding; remove it or describe the rule in the prompt instead")
            if key == "format" and value in UNENFORCED_FORMATS:
                raise ParamError(_top(param), f"{param}: format '{value}' (at {where}) is not supported; "
                                 f"supported formats: {', '.join(sorted(FORMATS | set(_INT_FORMATS)))} (others "
                                 "that JSON Schema does not define are taken as annotations)")
            if key == "$ref" and not str(value).startswith("#"):
                raise ParamError(_top(param), f"{param}: only local references ('#/...') are supported, got "
                                 f"'{value}' at {where}")
    return _engine_schema(schema, param)  # (the rewrite refuses what only it finds: an object no value satisfies, ...)


_COMPOSED = ("anyOf", "oneOf", "allOf", "$ref")  # an object's keys may be declared elsewhere then


def _map_schemas(node: Any, path: str, fn: Callable[[dict, str], dict]) -> Any:
    """A copy of `node` with fn(subschema, its JSON pointer) applied to every subschema that is an object,
    innermost first (fn gets a copy whose subschemas are already mapped)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _map_schemas(v, f"{path}/{key}/{k}", fn) for k, v in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_map_schemas(v, f"{path}/{key}/{i}", fn) for i, v in enumerate(out[key])]
    for key in SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _map_schemas(out[key], f"{path}/{key}", fn)
    return fn(out, path)


def _engine_schema(schema: Any, param: str) -> Any:
    """The schema xgrammar compiles for a checked one: what every output of it must match, in the forms
    xgrammar enforces. Annotations are left out; `format`s whose xgrammar rules are loose become
    patterns (FORMAT_PATTERNS) and OpenAPI's int32/int64 bounds; an object's required keys that it does not
    list in `properties` are listed (xgrammar does not require them otherwise), with the schema
    `patternProperties` or `additionalProperties` gives them; and objects that list their `properties`
    are closed to other keys unless they say otherwise (`_object`). ParamError for an object no JSON value
    satisfies, or one whose declared keys xgrammar would also let through as other keys."""
    import jsonschema

    types = jsonschema.Draft202012Validator.TYPE_CHECKER

    def refuse(message: str) -> NoReturn:
        raise ParamError(_top(param), f"{param}: {message}")

    def node(n: dict, path: str) -> dict:
        out = {k: v for k, v in n.items() if k in ENFORCED}
        _check_shape(out, path or "/", param)
        if isinstance(out.get("type"), list) and {"integer", "number"} <= set(out["type"]):
            out["type"] = [t for t in out["type"] if t != "integer"]  # (numbers include the integers)
        fmt = out.get("format")
        if fmt in FORMAT_PATTERNS:
            out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
        elif fmt in _INT_FORMATS:
            del out["format"]
            lo, hi = _INT_FORMATS[fmt]
            kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
            if "integer" in kinds:
                if "minimum" not in out and "exclusiveMinimum" not in out:
                    out["minimum"] = lo
                if "maximum" not in out and "exclusiveMaximum" not in out:
                    out["maximum"] = hi
        elif fmt is not None and fmt not in FORMATS:
            del out["format"]  # an annotation
        if "const" in out and "enum" in out:  # xgrammar wrote the const whatever the enum said
            if not any(json_equal(out["const"], v) for v in out["enum"]):
                raise ParamError(_top(param), f"{param}: the const at {path or '/'} is not in the enum beside it, so "
                                 "nothing satisfies the schema; change it")
            del out["enum"]
        kinds = out.get("type") if isinstance(out.get("type"), list) else [out["type"]] if "type" in out else None
        if kinds is not None and ("enum" in out or "const" in out):  # xgrammar writes these whatever the type
            values = [out["const"]] if "const" in out else list(out["enum"])
            kept = [v for v in values if any(types.is_type(v, k) for k in kinds)]  # (kinds: checked names)
            if not kept:
                key = "const" if "const" in out else "enum"
                raise ParamError(_top(param), f"{param}: no value of {key} (at {path or '/'}) has type "
                                 f"{json.dumps(out['type'])}, so nothing satisfies it; change the schema")
            if "enum" in out:
                out["enum"] = kept
        if "enum" in out or "const" in out:  # xgrammar writes these whatever the keywords beside them say
            out = _admitted_values(out, n, path or "/", param, defs)
        if kinds is not None and "number" in kinds and _no_short_number(out):
            raise ParamError(_top(param), f"{param}: the number range at {path or '/'} holds no number of at most "
                             f"{NUMBER_DECIMALS} decimals, the finest constrained decoding writes (its grammar would be "
                             "empty, and the reply cut short); widen the range")
        min_keys = out.get("minProperties")
        if isinstance(min_keys, int) and not isinstance(min_keys, bool) and min_keys >= 2:
            declared = set(out.get("properties") or {})
            open_keys = (out.get("additionalProperties", True) is not False or bool(out.get("patternProperties"))
                         or "propertyNames" in out)
            if open_keys and min_keys > len(declared & set(out.get("required") or ())):
                raise ParamError(_top(param), f"{param}: minProperties {min_keys} at {path or '/'} may be met by keys "
                                 "other than its required properties, which constrained decoding cannot keep distinct "
                                 "(it could write one key twice, which a parser reads once); require the keys in "
                                 "properties, or leave minProperties out")
        if kinds is not None and "integer" in kinds and "number" not in kinds:  # xgrammar takes whole bounds only
            for key, whole in (("minimum", math.ceil), ("maximum", math.floor),
                               ("exclusiveMinimum", math.floor), ("exclusiveMaximum", math.ceil)):
                if isinstance(out.get(key), float) and math.isfinite(out[key]):
                    out[key] = whole(out[key])  # the same integers: x >= 0.5 is x >= 1, x > 0.5 is x > 0
        if any(k in out for k in ("properties", "required", "patternProperties", "propertyNames")):
            out = _object(out, path or "/", param, defs)
        if isinstance(out.get("pattern"), str):
            out["pattern"] = served_pattern(out["pattern"], path)
        if isinstance(out.get("patternProperties"), dict):
            out["patternProperties"] = {served_pattern(p, f"{path}/patternProperties"): sub
                                        for p, sub in out["patternProperties"].items()}
        return out

    def served_pattern(pattern: str, where: str) -> str:
        try:
            served = xgrammar_pattern(pattern)
        except _Lookaround:
            raise ParamError(_top(param), f"{param}: the pattern {pattern!r} (at {where or '/'}) has a lookahead or "
                             "lookbehind, which constrained decoding does not enforce; write it without one") from None
        if served is None:
            raise ParamError(_top(param), f"{param}: the pattern {pattern!r} (at {where or '/'}) matches only "
                             "strings with a '\"', a '\\' or a control character, which constrained decoding "
                             "does not write; match them with a class that offers other characters too, or "
                             "leave them out")
        return served

    schema = composed(current_draft(hoisted(schema)), refuse, FORMATS | set(FORMAT_PATTERNS))
    _check_refs(schema, param)  # (references with keywords beside them that led back to each other: made bare)
    schema = finite(schema, refuse)
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    return _map_schemas(schema, "", node)


def _check_shape(schema: dict, where: str, param: str) -> None:
    """ParamError for a string's constraints xgrammar would not keep together: it drops a length beside a
    pattern or format (with a log line), and one of a pattern and a format."""
    shape = [k for k in ("pattern", "format") if k in schema and (k == "pattern" or schema[k] in FORMATS)]
    length = [k for k in ("minLength", "maxLength") if k in schema]
    if shape and length:
        raise ParamError(_top(param), f"{param}: {length[0]} together with {shape[0]} (at {where}) is not "
                         f"supported by constrained decoding; put the length in the pattern (e.g. "
                         "^[a-z]{1,8}$) or drop one of them")
    if len(shape) == 2:
        raise ParamError(_top(param), f"{param}: pattern together with format (at {where}) is not supported by "
                         "constrained decoding; keep one of them")


def _admitted_values(out: dict, original: dict, where: str, param: str, defs: dict) -> dict:
    """`out` with its enum (const) cut to the values the schema's other keywords admit: xgrammar writes the
    listed values as they are (`{"enum": ["a", "bb"], "maxLength": 1}` wrote "bb"). Checked by jsonschema
    against the client's keywords, formats included, references read in the schema's `defs` (one to the
    whole schema, `#`, is not followed: such an enum is left as it is)."""
    import jsonschema

    rest = {k: v for k, v in original.items() if k not in ("enum", "const")}
    if not set(rest) & (ENFORCED - {"type"}) or '"$ref": "#"' in json.dumps(rest):  # (the type was checked above)
        return out
    check = jsonschema.Draft202012Validator({**defs, **rest}, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    key = "const" if "const" in out else "enum"
    values = [out["const"]] if key == "const" else out["enum"]
    kept = [v for v in values if check.is_valid(v)]
    if not kept:
        raise ParamError(_top(param), f"{param}: no value of {key} (at {where}) satisfies the keywords beside it "
                         f"({', '.join(sorted(k for k in rest if k in ENFORCED))}), so nothing satisfies the schema; "
                         "change it")
    return out if key == "const" else {**out, "enum": kept}


NUMBER_DECIMALS = 6  # xgrammar's number ranges are written to this many decimal places


def _no_short_number(schema: dict) -> bool:
    """Whether the schema's bounds leave no number of at most NUMBER_DECIMALS decimals (xgrammar then compiles
    the range to an empty rule: '{"x": }' with finish_reason stop)."""
    scale = 10**NUMBER_DECIMALS

    def scaled(key: str, to_int: Callable[[float], int], step: int) -> int | None:
        """The bound as a count of 10^-NUMBER_DECIMALS, stepped inside where it is exclusive (None: unset)."""
        v = schema.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return None
        return to_int(v * scale) + step

    lows = [b for b in (scaled("minimum", math.ceil, 0), scaled("exclusiveMinimum", math.floor, 1)) if b is not None]
    highs = [b for b in (scaled("maximum", math.floor, 0), scaled("exclusiveMaximum", math.ceil, -1)) if b is not None]
    return bool(lows and highs) and max(lows) > min(highs)


def _object(out: dict, where: str, param: str, defs: dict | None = None) -> dict:
    """An object schema's keys as xgrammar should see them (see _engine_schema)."""
    def refuse(why: str) -> ParamError:
        return ParamError(_top(param), f"{param}: {why} (the object at {where}); change the schema")

    props = dict(out.get("properties") or {})
    required = list(out.get("required") or ())
    forbidden = [key for key, sub in props.items() if sub is False]  # `"a": false`: no object has the key
    for key in forbidden:
        if key in required:
            raise refuse(f"the required key '{key}' has the schema false, so no object satisfies it")
        del props[key]
    patterns = out.get("patternProperties") or {}
    extra = out.get("additionalProperties", True)
    names = out.get("propertyNames")
    if not any(k in out for k in _COMPOSED):  # (else its keys may come from the other schemas)
        for key in required:
            if key in props:
                continue
            match = [sub for p, sub in patterns.items() if search(p, key)]
            if len(match) > 1:
                raise refuse(f"the required key '{key}' is not in properties and matches several patternProperties, "
                             "which constrained decoding cannot enforce together")
            sub = match[0] if match else extra
            if sub is False:
                raise refuse(f"the required key '{key}' is neither in properties nor allowed as another key, so no "
                             "object satisfies it")
            props[key] = {} if sub is True else sub
        if names is not None:
            for key in list(props):
                if not name_ok(names, key, defs):
                    if key in required:
                        raise refuse(f"the required key '{key}' breaks propertyNames, so no object satisfies it")
                    del props[key]  # a key no valid object has
        closed = extra is False and not patterns
        if closed and isinstance(out.get("minProperties"), int) and out["minProperties"] > len(props):
            raise refuse(f"minProperties {out['minProperties']} exceeds the {len(props)} keys the object may have")
        if isinstance(out.get("maxProperties"), int) and out["maxProperties"] < len(set(required)):
            raise refuse(f"maxProperties {out['maxProperties']} is less than its {len(set(required))} required keys")
    # xgrammar writes a declared key through `properties`, but lets it through again (with another value,
    # or the same one over and over) as a key that matches patternProperties or, beside other keys
    # allowed, propertyNames. A pattern that names one declared key only, with nothing to add to its
    # schema, is left out.
    # a pattern whose keys are forbidden adds nothing to an object closed to other keys (below): left out,
    # as the compiler refused `false` there
    forbidden_patterns = {p for p, sub in patterns.items() if sub is False and not any(search(p, k) for k in props)}
    patterns = {p: sub for p, sub in patterns.items() if p not in forbidden_patterns
                and (_literal(p) not in props or sub not in (True, {}, props[_literal(p)]))}
    if "patternProperties" in out:
        out["patternProperties"] = patterns
    for key in props:
        for p in patterns:
            if search(p, key):
                raise refuse(f"the key '{key}' is in properties (or required) and matches the patternProperties "
                             f"'{p}', which constrained decoding cannot keep from writing it twice; rename the key "
                             "or narrow the pattern")
        if names is not None and extra is not False:
            raise refuse(f"propertyNames beside properties (here '{key}') and other keys allowed is not supported by "
                         "constrained decoding, which could write a listed key twice; set additionalProperties to "
                         "false, or leave properties out")
    if names is not None and extra is False and not patterns:  # only listed keys: those breaking it were left out
        del out["propertyNames"]  # (beside none listed, xgrammar wrote keys other than them: only {} was valid)
        out["properties"] = props
    if (patterns or forbidden_patterns) and out.get("additionalProperties") is not False:  # xgrammar let a key matching a pattern through
        out["additionalProperties"] = False  # as another key, of that schema's value: other keys left out (a narrowing)
    if props or "properties" in out:
        out["properties"] = props
    if "properties" in out and not any(k in out for k in OPEN_BY_DESIGN) and set(required) <= set(props):
        out["additionalProperties"] = False  # (the module docstring says why; `"properties": {}` too: only {})
    if forbidden and out.get("additionalProperties", True) is not False:
        raise refuse(f"the key '{forbidden[0]}' is forbidden (false) while other keys are allowed, which constrained "
                     "decoding cannot keep it from writing as one of them; set additionalProperties to false")
    for key, p in ((key, p) for key in forbidden for p in patterns if search(p, key)):
        raise refuse(f"the key '{key}' is forbidden (false) and matches the patternProperties '{p}', which constrained "
                     "decoding cannot keep it from writing as such a key; narrow the pattern")
    return out


def _literal(pattern: str) -> str | None:
    """The one string an anchored pattern without operators (`^tag$`, `^a\\.b$`) matches, else None."""
    m = re.fullmatch(r"\^((?:[^\\.^$*+?()\[\]{}|]|\\[^A-Za-z0-9])*)\$", pattern)
    return re.sub(r"\\(.)", r"\1", m.group(1)) if m else None


def xgrammar_pattern(pattern: str) -> str | None:
    """`pattern` as xgrammar must see it to write only valid JSON strings whose values match it; None if
    no such string can be written.

    xgrammar writes a pattern made of literals as raw text, so a literal `"`, `\\` or control character
    in it broke the JSON (`^a"b$` gave `"a"b"`, `^a\\nb$` a newline); in its other patterns it leaves
    those characters out. They are never written, then, the same way everywhere: a part of the pattern
    that needs one is dropped (an alternative, an optional part) and the pattern is None if nothing is
    left; classes lose them (negated classes are told to). What is produced still matches the pattern.
    A pattern Python's `re` cannot read, or with back-references or inline flags (which xgrammar does
    not take either), is passed on as written (`_optional_groups`); one with a lookaround raises
    _Lookaround."""
    try:
        return _json_pattern(_sre.parse(pattern).data)
    except (re.error, _Unsupported, RecursionError):
        return _optional_groups(pattern)


class _Unsupported(Exception):
    pass


class _Lookaround(Exception):
    """A lookahead or lookbehind: xgrammar 0.2.9 takes a lookahead in a JSON Schema pattern and does not
    enforce it (`^(?=zzz)[a-z]{3}$` wrote "abc"), so it is refused, not passed on."""


_UNWRITABLE = "\\x00-\\x1f\\x22\\x5c"  # (as a class's members) what a JSON string holds only escaped
_CATEGORIES = {"CATEGORY_DIGIT": "\\d", "CATEGORY_NOT_DIGIT": "\\D", "CATEGORY_SPACE": "\\s",
               "CATEGORY_NOT_SPACE": "\\S", "CATEGORY_WORD": "\\w", "CATEGORY_NOT_WORD": "\\W"}


def _writable(c: int) -> bool:
    return c >= 0x20 and c not in (0x22, 0x5C)


def _char(c: int) -> str:
    """Character c in a regex, in a class or out: ASCII punctuation and controls as \\xHH escapes."""
    ch = chr(c)
    return ch if ch.isalnum() or ch == " " or c > 127 else f"\\x{c:02x}"


def _json_pattern(items: list, depth: int = 0) -> str | None:
    """Regex text of a parsed pattern (`re._parser`'s items) without the characters JSON escapes; None
    where every match needs one."""
    if depth > 100:
        raise _Unsupported
    out = []
    for op, av in items:
        name = str(op)
        if name == "LITERAL":
            if not _writable(av):
                return None
            out.append(_char(av))
        elif name == "NOT_LITERAL":
            out.append(f"[^{_char(av)}{_UNWRITABLE}]")
        elif name == "ANY":
            out.append(".")
        elif name == "IN":
            negated = bool(av) and str(av[0][0]) == "NEGATE"
            parts = []
            for iop, iav in av[1:] if negated else av:
                iname = str(iop)
                if iname == "LITERAL":
                    parts += [_char(iav)] if negated or _writable(iav) else []
                elif iname == "RANGE":
                    lo, hi = iav
                    spans = [(lo, hi)] if negated else [
                        (a, b) for a, b in ((max(lo, 0x20), min(hi, 0x21)), (max(lo, 0x23), min(hi, 0x5B)),
                                            (max(lo, 0x5D), hi)) if a <= b]
                    parts += [_char(a) if a == b else f"{_char(a)}-{_char(b)}" for a, b in spans]
                elif iname == "CATEGORY" and str(iav) in _CATEGORIES:
                    parts.append(_CATEGORIES[str(iav)])  # (xgrammar leaves the unwritable out of these)
                else:
                    raise _Unsupported
            if negated:
                out.append(f"[^{''.join(parts)}{_UNWRITABLE}]")
            elif not parts:
                return None
            else:
                out.append(f"[{''.join(parts)}]")
        elif name == "BRANCH":  # an empty alternative (re's parser makes `b\\.|b` into `b(?:\\.|)`) as {0,1}
            alts = [_json_pattern(alt.data, depth + 1) for alt in av[1]]
            full = [a for a in alts if a]
            if not full:
                if "" in alts:
                    continue
                return None
            out.append(f"(?:{'|'.join(full)})" + ("{0,1}" if "" in alts else ""))
        elif name == "SUBPATTERN":
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise _Unsupported
            body = _json_pattern(sub.data, depth + 1)
            if body is None:
                return None
            out.append(f"(?:{body})" if body else "")
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):  # laziness does not change what matches whole
            lo, hi, sub = av
            body = _json_pattern(sub.data, depth + 1)
            if body is None and lo > 0:
                return None
            if not body:
                continue
            if hi != _sre.MAXREPEAT:
                out.append(_repeat(body, lo, hi))
            else:  # not `{lo,}`: xgrammar 0.2.9 let `(?:b){0,}` inside a group take what `b*` does not
                out.append((_repeat(body, lo - 1, lo - 1) if lo > 1 else "") + f"(?:{body})" + ("+" if lo else "*"))
        elif name in ("ASSERT", "ASSERT_NOT"):
            raise _Lookaround
        elif name == "AT" and str(av) in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
            out.append("^")
        elif name == "AT" and str(av) in ("AT_END", "AT_END_STRING"):
            out.append("$")
        else:
            raise _Unsupported
    return "".join(out)


_MAX_COUNT = 128  # the largest count range xgrammar 0.2.9 keeps right after an unbounded repetition (`_repeat`)


def _repeat(body: str, lo: int, hi: int) -> str:
    """`(?:body){lo,hi}`, one item of it first where the count is past 128:
    b{1,129} as b{1,1}b{0,128}, b{200} as b{1,1}b{199,199}, the same language. xgrammar 0.2.9 lost such a
    count right after an unbounded repetition in a JSON Schema pattern (`^[ae]*x{1,129}$` wrote "xa"); after
    a bounded item it keeps it, and compiles it as fast as before (a split into pieces of 128 took a
    `{1,1000}` past the 30 s compile limit)."""
    if hi <= _MAX_COUNT:
        return f"(?:{body}){{{lo},{hi}}}"
    first = min(lo, 1)
    return f"(?:{body}){{{first},1}}(?:{body}){{{lo - first},{hi - 1}}}"


def _optional_groups(pattern: str) -> str:
    """`pattern` with every optional group `(...)?` written `(...){0,1}`: the same language. xgrammar 0.2.9
    turns a JSON Schema pattern's optional group with a repetition inside, between other parts, into
    one that drops the group's first part: `^x(ab+)?Z$` took "xbZ" (its regex kind is not affected).
    tests/executor/test_grammar.py checks random patterns against Python's `re` on every short string."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == ")" and pattern[i + 1:i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def embedded(schema: Any, at: str) -> Any:
    """`schema` to be placed at the JSON pointer `at` of a larger schema: its local references (`#`,
    `#/$defs/x`) rewritten to point where they will be. A tool's parameters go under `$defs` of the
    schema that forces one of several calls, so that pydantic's `#/$defs/Model` still resolves."""
    def node(n: dict, path: str) -> dict:
        ref = n.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            n["$ref"] = at + ref[1:]
        return n

    return _map_schemas(schema, "", node)


def _vllm_style(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return json_schema_output(value, param)
    if kind == "json_object":
        return StructuredOutput("json_object", "", _top(param))
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ParamError(_top(param), f"{param} must be a non-empty list of non-empty strings")
        return StructuredOutput("regex", "|".join(re.escape(c) for c in value), _top(param))
    if not isinstance(value, str) or not value.strip():
        raise ParamError(_top(param), f"{param} must be a non-empty string")
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as e:
            raise ParamError(_top(param), f"{param} is not a valid regular expression: {e}") from None
    return StructuredOutput("regex" if kind == "regex" else "grammar", value, _top(param))


def _top(param: str) -> str:
    """The 400's `param` for a schema refused at the dotted path `param` (and for what the engine refuses
    of it): the request field the path starts with, or a tool's parameters, which OpenAI names whole."""
    tool = re.match(r"tools\.\[\d+\]\.function\.parameters", param)
    return tool.group(0) if tool else param.split(".")[0]
