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
draft, `jsonschema`), and every keyword in it must be one the grammar engine enforces. xgrammar skips
keywords it does not implement (`multipleOf`, `uniqueItems`, `not`, `if`, ...); a request asking for
one would get output that silently breaks its schema, so it is refused with a 400 naming the keyword
and where it is. `oneOf` is enforced as `anyOf` (a value matching two branches is not excluded), and
a `pattern` is matched as a whole (anchored), which only narrows what is produced. `minLength` or
`maxLength` beside a `pattern` or `format` is refused: xgrammar would drop the length.

The schema sent to the engine closes every object that lists its `properties` to other keys
(`_closed_objects`), unless it says otherwise: still the client's schema, minus the keys a small
model would otherwise invent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from scheduler.sampling_params import ParamError, StructuredOutput

# keywords the grammar engine enforces (checked one by one against xgrammar 0.2.x in the tests)
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "pattern", "minLength", "maxLength", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
# keywords that say nothing about which values are valid
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
    "readOnly", "writeOnly", "discriminator", "nullable", "strict",
})
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uuid"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")  # one schema (or a boolean)
# JSON containers a schema may nest (a `properties` map and the schema in it are two). The checks below
# and the metaschema validation recurse: a few KB of deeper nesting would exhaust Python's stack and
# answer 500. OpenAI allows 10 levels of object nesting in a schema; this is several times that.
MAX_SCHEMA_DEPTH = 64


def structured_output(body: Any) -> StructuredOutput | None:
    """The request's constraint, or None; ParamError naming the field for a bad or unsupported one."""
    found: list[StructuredOutput] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
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
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar"), ("regex", "regex"), ("ebnf", "grammar"), ("json_schema", "json"),
                        ("grammar", "grammar")):
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
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ParamError(_top(param), f"{param} is not valid JSON: {e}") from None
    check_json_schema(schema, param)
    return schema_output(schema, param)


def schema_output(schema: Any, param: str) -> StructuredOutput:
    """The engine's constraint for a schema already checked (`check_json_schema`), objects closed."""
    return StructuredOutput("json_schema", json.dumps(_closed_objects(schema), ensure_ascii=False), _top(param))


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


_MISSING = object()


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/a", JSON-pointer escapes) points at, or _MISSING."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else ([] if ref == "#" else [None]):
        if part is None:
            return _MISSING
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _check_refs(schema: Any, param: str) -> None:
    """Every local `$ref` points at a subschema, and no chain of bare references comes back to where it
    started: such a schema matches no JSON value at all, and the grammar built from it would let the
    model say nothing (an empty reply reported as finished)."""
    bare = lambda n: isinstance(n, dict) and isinstance(n.get("$ref"), str) and not (  # noqa: E731
        set(n) - ANNOTATIONS - {"$ref", "$defs", "definitions"})
    for path, node in _schemas(schema, ""):
        ref, seen, target = node.get("$ref"), {id(node)}, node
        if not isinstance(ref, str) or not ref.startswith("#"):
            continue
        while True:
            r = target["$ref"]
            target = _resolve(schema, r)
            if target is _MISSING:
                raise ParamError(_top(param), f"{param}: the $ref '{r}' (at {path or '/'}) points at nothing in the schema")
            if id(target) in seen:
                raise ParamError(_top(param), f"{param}: the $ref at {path or '/'} leads back to itself through "
                                 "references alone, so no JSON value matches; give the schema some structure")
            seen.add(id(target))
            if not bare(target) or not str(target["$ref"]).startswith("#"):
                break


def check_json_schema(schema: Any, param: str) -> None:
    """ParamError(param) unless `schema` is a valid JSON Schema made only of keywords we enforce."""
    check_valid_schema(schema, param)
    for path, node in _schemas(schema, ""):
        shape, length = [k for k in ("pattern", "format") if k in node], [k for k in ("minLength", "maxLength") if k in node]
        if shape and length:  # xgrammar drops the length then (with a log line), so the limit would not hold
            raise ParamError(_top(param), f"{param}: {length[0]} together with {shape[0]} (at {path or '/'}) is not "
                             f"supported by constrained decoding; put the length in the pattern (e.g. "
                             "^[a-z]{1,8}$) or drop one of them")
        for key, value in node.items():
            if key in ANNOTATIONS:
                continue
            if key not in ENFORCED:
                raise ParamError(_top(param), f"{param}: the keyword '{key}' (at {path or '/'}) is not supported "
                                 "by constrained decoding; remove it or describe the rule in the prompt instead")
            if key == "format" and value not in FORMATS:
                raise ParamError(_top(param), f"{param}: format '{value}' (at {path or '/'}) is not supported; "
                                 f"supported formats: {', '.join(sorted(FORMATS))}")
            if key == "allOf" and len(value) > 1:
                raise ParamError(_top(param), f"{param}: allOf with more than one schema (at {path or '/'}) is not "
                                 "supported; merge them into one schema")
            if key == "items" and isinstance(value, list):
                raise ParamError(_top(param), f"{param}: items as a list (at {path or '/'}) is not supported; "
                                 "use prefixItems")
            if key == "$ref" and not str(value).startswith("#"):
                raise ParamError(_top(param), f"{param}: only local references ('#/...') are supported, got "
                                 f"'{value}' at {path or '/'}")


def _schemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every subschema of `node` that is an object, with its JSON pointer."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            yield from _schemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or ()) if isinstance(node.get(key), list) else ():
            yield from _schemas(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        yield from _schemas(node.get(key), f"{path}/{key}")


_OPEN_BY_DESIGN = ("additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
                   "anyOf", "oneOf", "allOf", "$ref")


def _closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its `properties` (all its
    `required` among them) and says nothing else about other keys. A schema allows extra keys unless
    told otherwise; a model left free to invent them wanders off, while any output of the narrowed
    schema still matches the original. (xgrammar's own strict mode closes *every* object, which
    makes `patternProperties` or `minProperties` without `properties` impossible to satisfy.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(v) for v in out[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key])
    props = out.get("properties")
    if isinstance(props, dict) and not any(k in out for k in _OPEN_BY_DESIGN) \
            and set(out.get("required", ())) <= set(props):
        out["additionalProperties"] = False
    return out


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
    """The request field a dotted parameter path starts with (the 400's `param` for what the engine refuses)."""
    return param.split(".")[0]
