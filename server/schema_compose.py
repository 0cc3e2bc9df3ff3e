"""JSON Schema composition rewritten into the forms the grammar engine enforces.

xgrammar compiles `$ref`, `anyOf`/`oneOf` and `allOf` by their subschemas alone: keywords beside them were
dropped (`{"$ref": "#/$defs/n", "maximum": 5}` wrote 70, `{"type": "integer", "anyOf": [...]}` wrote a
string), and so were string and number keywords in a schema without `type` (`{"maxLength": 2}` wrote any
string). JSON Schema applies keywords beside a composition together with it, so `composed` folds them in:

- `{"$ref": R, ...beside}` is a reference to a new `$defs` entry: R's schema intersected with the keywords
  beside it (one entry per R and keywords, so a recursive definition meeting them again refers to it);
- `{"allOf": [A, B], ...beside}` is A ∩ B ∩ beside;
- `{"anyOf": [A, B], ...beside}` is anyOf [A ∩ beside, B ∩ beside] (oneOf likewise, still enforced as
  anyOf); branches nothing satisfies are dropped;
- a schema without `type`, `enum`, `const` or composition whose keywords constrain one kind of value
  (`pattern`, `minimum`, `properties`, `minItems`, ...) is that kind; several kinds, anyOf of them.

`intersect` is exact for what it merges: bounds take the tighter value, `type`s and `enum`s their common
values, `required` the union, `properties` each property's two schemas (a key one side forbids is
false), subschemas recursively. What it cannot merge exactly (two different `pattern`s or `format`s,
two `prefixItems`, `patternProperties` meeting another schema's keys) is refused, naming the keyword, as
is a result nothing satisfies (inside an anyOf branch: the branch is dropped). Every output of the
rewritten schema matches the client's.

First, `hoisted` points references into places the rewrite reshapes (a property, a branch, OpenAPI's
`components`) at copies under `$defs`, and `current_draft` spells older drafts' forms in 2020-12's
(validated by their own metaschema, they would otherwise be read wrongly): `items` as a list is
`prefixItems` (with `additionalItems` as `items`), draft-04's boolean `exclusiveMinimum`/`exclusiveMaximum`
the numeric bound, and up to draft-07 the keywords beside a `$ref` are left out, as those drafts ignore them.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

Refuse = Callable[[str], NoReturn]  # raises the request's 400 with this message

MISSING = object()
# the keywords that constrain each kind of value (`format` is a string's unless it is an integer size)
KIND_KEYWORDS = {
    "string": ("pattern", "minLength", "maxLength", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
}
INTEGER_FORMATS = ("int32", "int64")
_COMPOSITION = ("$ref", "allOf", "anyOf", "oneOf")
_DEFS = ("$defs", "definitions")
# constraints folded into a composition beside them (annotations are not constraints; $defs stay put)
_CONSTRAINTS = frozenset({"type", "enum", "const", *(k for ks in KIND_KEYWORDS.values() for k in ks)})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")  # the larger one holds
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")  # the smaller one holds
MAX_NODES = 4096  # subschemas the rewrite may add (anyOf beside anyOf multiplies their branches)
# where any draft's schema holds subschemas (name -> schema, [schema, ...], one schema): what the drafts'
# rewrites map over, `not` and `if` included
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains")
# of those, where the checks and the engine's rewrite look (the keywords only they hold, `not`, ..., are refused)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")  # one schema (or a boolean)
# an object schema with one of these may take keys it does not list in `properties` (left open)
OPEN_BY_DESIGN = ("additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
                  "anyOf", "oneOf", "allOf", "$ref")
_ENTRY = re.compile(r"#/(\$defs|definitions)/[^/]+")  # a reference to a whole $defs entry


def resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/a", JSON-pointer and percent escapes) points at, or
    MISSING."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else ([] if ref == "#" else [None]):
        if part is None:
            return MISSING
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


_OLD_DRAFTS = re.compile(r"json-schema\.org/draft-0[3-7]/")  # drafts in which `$ref` ignores the keywords beside it


def current_draft(node: Any, refs_alone: bool | None = None) -> Any:
    """A copy of `node` with older drafts' spellings in 2020-12's (module docstring); a 2020-12 schema
    comes back equal (a list `items` or a boolean exclusive bound is invalid there). Only subschemas are
    read: a `const`, an `enum` value or a property named `items` is data, left as it is."""
    if not isinstance(node, dict):
        return node
    if refs_alone is None:  # (the root says which draft)
        refs_alone = bool(_OLD_DRAFTS.search(str(node.get("$schema", ""))))
    out = _subschemas_mapped(node, lambda sub: current_draft(sub, refs_alone))
    if refs_alone and isinstance(out.get("$ref"), str):  # draft-07 and older: the keywords beside it do not apply
        out = {k: v for k, v in out.items() if k == "$ref" or k in _DEFS}
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    else:
        out.pop("additionalItems", None)  # ignored without a list `items`, by every draft
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(key), bool):  # draft-04: a flag on the bound beside it
            if out.pop(key) and bound in out:
                out[key] = out.pop(bound)
    return out


def _subschemas_mapped(node: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of `node` with `fn` applied to each of its own subschemas (in every draft's places for them;
    `const`, `enum` and the names in `properties` are data, not read)."""
    out = dict(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, "items"):
        if isinstance(out.get(key), list):
            out[key] = [fn(v) for v in out[key]]
    for key in (*_SUBSCHEMA_VALUES, "additionalItems"):
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])
    return out


def hoisted(root: Any) -> Any:
    """`root` with every local `$ref` that points anywhere but `#` or a `$defs`/`definitions` entry (into a
    property, an `anyOf` branch, OpenAPI's `components`) pointed at a copy of its target put under
    `$defs`: the rewrites change the schema's shape (a branch dropped, `allOf` folded, annotations left
    out), which such a pointer would not follow."""
    if not isinstance(root, dict):
        return root
    names: dict[str, str] = {}  # ref -> the $defs entry it now names
    added: dict[str, Any] = {}
    taken = set(root.get("$defs") or {}) if isinstance(root.get("$defs"), dict) else set()

    def entry(ref: str) -> str | None:
        if ref in names:
            return names[ref]
        target = resolve(root, ref)
        if target is MISSING:
            return None  # (refused where the references are checked)
        name = f"ref{len(names)}"
        while name in taken:
            name += "_"
        taken.add(name)
        names[ref] = name
        added[name] = rewrite(target)
        return name

    def rewrite(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = _subschemas_mapped(node, rewrite)
        ref = out.get("$ref")
        if isinstance(ref, str) and ref != "#" and not _ENTRY.fullmatch(ref) and ref.startswith("#"):
            name = entry(ref)
            if name is not None:
                out["$ref"] = f"#/$defs/{name}"
        return out

    out = rewrite(root)
    if added:
        out["$defs"] = {**(out.get("$defs") if isinstance(out.get("$defs"), dict) else {}), **added}
    return out


def composed(root: Any, refuse: Refuse, string_formats: frozenset[str]) -> Any:
    """`root` with every composition's sibling keywords folded into it, and kinds written out (module
    docstring). `refuse` for what cannot be merged exactly, or is satisfied by nothing. A `$ref` with
    keywords beside it becomes a reference to a new `$defs` entry, its target intersected with them, one
    for each (target, keywords) pair: a recursive definition that meets the same keywords again refers to
    the entry being made, so the rewrite stays finite."""
    expanded: dict[str, str] = {}  # (ref, keywords beside it) -> the $defs entry made for them
    made: dict[str, Any] = {}  # those entries
    taken = set(root.get("$defs") or {}) if isinstance(root, dict) and isinstance(root.get("$defs"), dict) else set()
    following: list[str] = []  # bare references being followed, innermost last (no cycle: _check_refs)
    budget = [MAX_NODES + 4 * _count(root)]  # (a rewritten subtree is walked again)

    def spend(where: str) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            refuse(f"the schema's compositions (anyOf beside anyOf, $ref with keywords beside it) expand it past "
                   f"what constrained decoding is given to write out (at {where or '/'}); write the combinations "
                   "out, or simplify them")

    def walk(node: Any, where: str) -> Any:
        if not isinstance(node, dict):
            return node
        spend(where)
        out = dict(node)
        for key in ("properties", "patternProperties", *_DEFS):
            if isinstance(out.get(key), dict):
                out[key] = {k: walk(v, f"{where}/{key}/{k}") for k, v in out[key].items()}
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(out.get(key), list):
                out[key] = [walk(v, f"{where}/{key}/{i}") for i, v in enumerate(out[key])]
        for key in ("items", "additionalProperties", "propertyNames"):
            out[key] = walk(out[key], f"{where}/{key}") if key in out else MISSING
            if out[key] is MISSING:
                del out[key]
        return fold(out, where)

    def target(ref: str, where: str) -> Any:
        name = ref[len("#/$defs/"):] if ref.startswith("#/$defs/") else None
        if name in expanded.values() and name not in made:  # (being made: it leads back to itself)
            refuse(f"a $ref with keywords beside it (at {where or '/'}) leads back to itself through allOf or a "
                   "composed anyOf, which cannot be written out; move the keywords into the referenced schema")
        found = made[name] if name in made else resolve(root, ref)  # (an entry made here is read as made)
        if found is MISSING:
            refuse(f"the $ref '{ref}' (at {where or '/'}) points at nothing in the schema")
        return {k: v for k, v in found.items() if k not in _DEFS} if isinstance(found, dict) else found

    def plain(node: Any, where: str) -> Any:
        """`node` with a top-level `$ref` replaced by what it points at (one level: references inside stay),
        intersected with the rest; else `node`."""
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return node
        ref = node["$ref"]
        if ref in following:  # (a loop of bare references: refused where references are checked)
            refuse(f"the $ref '{ref}' (at {where or '/'}) leads back to itself through references alone")
        following.append(ref)
        try:
            body = plain(walk(target(ref, where), where), where)
        finally:
            following.pop()
        return intersect(body, {k: v for k, v in node.items() if k != "$ref"}, where, refuse)

    def expand(node: dict, where: str) -> Any:
        """A `$ref` with keywords beside it: a reference to the $defs entry of its target and them."""
        ref, rest = node["$ref"], {k: v for k, v in node.items() if k != "$ref" and k not in _DEFS}
        key = json.dumps([ref, rest], sort_keys=True)
        if key not in expanded:
            name = f"composed{len(expanded)}"
            while name in taken:
                name += "_"
            taken.add(name)
            expanded[key] = name
            made[name] = walk(intersect(target(ref, where), rest, where, refuse), where)
        if made.get(expanded[key]) is False:  # nothing satisfies it (a branch around it is dropped)
            return False
        return {**{k: v for k, v in node.items() if k in _DEFS}, "$ref": f"#/$defs/{expanded[key]}"}

    def fold(node: dict, where: str) -> Any:
        beside = {k: v for k, v in node.items() if k in _CONSTRAINTS}
        if isinstance(node.get("$ref"), str) and (beside or any(k in node for k in ("anyOf", "oneOf", "allOf"))):
            return expand(node, where)
        if isinstance(node.get("allOf"), list):
            keep = {k: v for k, v in node.items() if k in _DEFS}
            merged: Any = {k: v for k, v in node.items() if k != "allOf" and k not in _DEFS}
            for i, part in enumerate(node["allOf"]):
                merged = intersect(merged, plain(part, f"{where}/allOf/{i}"), where, refuse)
            return walk(_with(merged, keep), where)
        if isinstance(node.get("anyOf"), list) and isinstance(node.get("oneOf"), list):  # both must hold
            pairs = [(a, b) for a in node["anyOf"] for b in node["oneOf"]]
            node = {k: v for k, v in node.items() if k != "oneOf"}
            node["anyOf"] = [x for x in (intersect(plain(a, where), plain(b, where), where, refuse, strict=False)
                                         for a, b in pairs) if x is not False]
            if not node["anyOf"]:
                refuse(f"no branch of anyOf (at {where or '/'}) holds together with one of oneOf, so nothing "
                       "satisfies the schema; change it")
            return walk(node, where)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and beside:
                rest = {k: v for k, v in node.items() if k not in _CONSTRAINTS and k != key}
                branches = []
                for i, branch in enumerate(node[key]):
                    spend(where)
                    at = f"{where}/{key}/{i}"
                    ref = branch.get("$ref") if isinstance(branch, dict) else None
                    b = intersect({k: v for k, v in branch.items() if k != "$ref"} if ref else branch, beside, at,
                                  refuse, strict=False)
                    if b is not False:  # (a reference keeps its keywords beside it: `expand` folds them in)
                        branches.append(walk({**b, "$ref": ref} if ref else b, at))
                return {**rest, key: branches} if branches else False  # (nothing satisfies it: a branch of an
                # anyOf around it is dropped, a property left out; elsewhere refused below or by the compiler)
        if isinstance(node.get(key := "anyOf"), list) or isinstance(node.get(key := "oneOf"), list):
            branches = [b for b in node[key] if b is not False]  # a branch nothing satisfies adds nothing
            return {**node, key: branches} if branches else False
        return _kinds(node, string_formats)

    if not isinstance(root, dict):
        return root
    out = walk(root, "")
    if out is False:
        refuse("no branch of its anyOf/oneOf holds together with the keywords beside it, so nothing satisfies "
               "the schema; change it")
    if made and isinstance(out, dict):  # (a root folded to `true` refers to none of them)
        out = {**out, "$defs": {**(out.get("$defs") if isinstance(out.get("$defs"), dict) else {}), **made}}
    return out


def _count(node: Any) -> int:
    """How many JSON objects `node` holds (itself included), without recursion."""
    count, stack = 0, [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            count += 1
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return count


def _with(node: Any, defs: dict) -> Any:
    return {**node, **defs} if isinstance(node, dict) and defs else node


def _kinds(node: dict, string_formats: frozenset[str]) -> dict:
    """A schema with no `type`, `enum`, `const` or composition: the kind its keywords constrain, written as
    its `type` (keywords of several kinds: anyOf one schema for each). JSON Schema lets values of other
    kinds through untouched, which xgrammar took as leave to write anything: a narrowing, as objects'."""
    if any(k in node for k in ("type", "enum", "const", *_COMPOSITION)):
        return node
    fmt = node.get("format")

    def constrains(kind: str, key: str) -> bool:
        if key != "format":
            return key in node
        return fmt in string_formats if kind == "string" else kind == "number" and fmt in INTEGER_FORMATS

    kinds = {kind: [k for k in keys if constrains(kind, k)] for kind, keys in KIND_KEYWORDS.items()}
    kinds = {kind: keys for kind, keys in kinds.items() if keys}
    if not kinds:
        return node
    if len(kinds) == 1:
        kind = next(iter(kinds))
        return {**node, "type": "integer" if kind == "number" and fmt in INTEGER_FORMATS else kind}
    owned = {k for keys in kinds.values() for k in keys}
    rest = {k: v for k, v in node.items() if k not in owned}
    return {**rest, "anyOf": [_kinds({k: node[k] for k in keys}, string_formats) for keys in kinds.values()]}


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality, as JSON Schema's `enum` and `const` compare: 1 is 1.0, and not true."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _type_set(t: Any) -> set[str]:
    return set(t) if isinstance(t, list) else {t}


def intersect(a: Any, b: Any, where: str, refuse: Refuse, *, strict: bool = True) -> Any:
    """The schema of the values both `a` and `b` admit (module docstring), or False where none are (with
    `strict`, a refusal instead: nothing satisfies the schema)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return _none(where, "a subschema is false", refuse, strict)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return _none(where, "a subschema is not a schema", refuse, strict)
    out: dict[str, Any] = {}
    for key in [*a, *(k for k in b if k not in a)]:
        if key not in b or key not in a or json_equal(a[key], b[key]):
            out[key] = a[key] if key in a else b[key]
        elif key == "type":
            ta, tb = _type_set(a[key]), _type_set(b[key])
            common = (ta & tb) | ({"integer"} if ("number" in ta and "integer" in tb)
                                  or ("integer" in ta and "number" in tb) else set())
            if not common:
                return _none(where, f"no value has type {json.dumps(a[key])} and type {json.dumps(b[key])}",
                             refuse, strict)
            order = a[key] if isinstance(a[key], list) else [a[key]]
            kept = [t for t in order if t in common] + sorted(common - set(order))
            out[key] = kept[0] if len(kept) == 1 else kept
        elif key in _LOWER:
            out[key] = max(a[key], b[key])
        elif key in _UPPER:
            out[key] = min(a[key], b[key])
        elif key == "required":
            out[key] = [*a[key], *(k for k in b[key] if k not in a[key])]
        elif key == "enum":
            out[key] = [v for v in a[key] if any(json_equal(v, w) for w in b[key])]
            if not out[key]:
                return _none(where, "no value is in both enums", refuse, strict)
        elif key == "const":
            return _none(where, "two different consts must both hold", refuse, strict)
        elif key in ("items", "additionalProperties", "propertyNames"):  # (false is a schema here: none may be)
            out[key] = intersect(a[key], b[key], f"{where}/{key}", refuse, strict=False)
        elif key in _DEFS:
            clash = [n for n in a[key] if n in b[key] and not json_equal(a[key][n], b[key][n])]
            if clash:
                refuse(f"two schemas composed at {where} define '{key}/{clash[0]}' differently; rename one")
            out[key] = {**a[key], **b[key]}
        elif key == "properties":
            continue  # below, with the other side's rule for keys it does not list
        elif key in _CONSTRAINTS or key in ("anyOf", "oneOf", "allOf", "$ref"):
            refuse(f"'{key}' is set differently in schemas that must both hold (at {where or '/'}), which constrained "
                   "decoding cannot combine; merge them into one schema")
        else:
            out[key] = a[key]  # an annotation: either will do (the compiled schema leaves them out)
    if "enum" in out and "const" in out:
        if not any(json_equal(out["const"], v) for v in out["enum"]):
            return _none(where, "the const is not in the enum", refuse, strict)
        del out["enum"]
    for x, y in ((a, b), (b, a)):  # keys one side governs by pattern, the other by a rule for all others
        if x.get("patternProperties") and not y.get("patternProperties") and (
                y.get("additionalProperties", True) is not True or "properties" in y):
            refuse(f"patternProperties in one schema composed at {where} and properties or additionalProperties in "
                   "another cannot be combined by constrained decoding; write them in one schema")
    if "properties" in a or "properties" in b:
        props = _properties(a, b, where, refuse)
        missing = [k for k in out.get("required", ()) if props.get(k, True) is False]
        if missing:
            return _none(where, f"the required key '{missing[0]}' is forbidden by one of the schemas", refuse, strict)
        out["properties"] = props  # (a key one side forbids stays, as false: the object must not let it through)
    for x, y in ((a, b), (b, a)):  # one side's prefixItems, the other's items: each item must hold both
        if "prefixItems" in x and "prefixItems" not in y and "items" in y:
            out["prefixItems"] = [intersect(p, y["items"], f"{where}/prefixItems/{i}", refuse)
                                  for i, p in enumerate(x["prefixItems"])]
            if "items" not in x:
                out["items"] = y["items"]
    why = _impossible(out)
    return out if why is None else _none(where, why, refuse, strict)


def _impossible(schema: dict) -> str | None:
    """Why nothing satisfies a merged schema, where its keywords say so alone (bounds past each other for its
    only kind, no `enum` value or `const` of its types); else None."""
    import jsonschema

    kinds = _type_set(schema["type"]) if "type" in schema else None
    if kinds is not None:
        types = jsonschema.Draft202012Validator.TYPE_CHECKER
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if values is not None and not any(types.is_type(v, k) for v in values for k in kinds):
            return f"no value of {'const' if 'const' in schema else 'enum'} has type {json.dumps(schema['type'])}"
    numbers = {"number", "integer"}
    for low, high, kind in (("minLength", "maxLength", {"string"}), ("minItems", "maxItems", {"array"}),
                            ("minProperties", "maxProperties", {"object"}), ("minimum", "maximum", numbers),
                            ("exclusiveMinimum", "maximum", numbers), ("minimum", "exclusiveMaximum", numbers),
                            ("exclusiveMinimum", "exclusiveMaximum", numbers)):
        lo, hi = schema.get(low), schema.get(high)
        if kinds is None or not kinds <= kind or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in (lo, hi)):
            continue
        if lo > hi or (lo == hi and (low.startswith("exclusive") or high.startswith("exclusive"))):
            return f"{low} {lo} is past {high} {hi}"
    return None


def _properties(a: dict, b: dict, where: str, refuse: Refuse) -> dict[str, Any]:
    """Each key either side lists: what each side lets that key be (its `properties` entry and the
    `patternProperties` matching it, else its `additionalProperties`; False where `propertyNames` refuses
    the name), intersected; False for a key one side forbids."""
    def rule(side: dict, key: str) -> Any:
        listed = side.get("properties") or {}
        rules = [listed[key]] if key in listed else []
        rules += [sub for p, sub in (side.get("patternProperties") or {}).items() if search(p, key)]
        if not rules:
            rules = [side.get("additionalProperties", True)]
        if "propertyNames" in side and not name_ok(side["propertyNames"], key):
            return False
        out: Any = True
        for sub in rules:
            out = intersect(out, sub, f"{where}/properties/{key}", refuse, strict=False)
        return out

    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    return {k: intersect(rule(a, k), rule(b, k), f"{where}/properties/{k}", refuse, strict=False)
            for k in [*pa, *(k for k in pb if k not in pa)]}


def _none(where: str, why: str, refuse: Refuse, strict: bool) -> bool:
    if strict:
        refuse(f"{why} (at {where or '/'}), so nothing satisfies the schema; change it")
    return False


def search(pattern: str, key: str) -> bool:
    """Whether a JSON Schema pattern (unanchored, as patternProperties' are) matches `key`; a pattern
    Python cannot read counts as matching (the cautious answer for the checks that ask)."""
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return True


def name_ok(names: Any, key: str, defs: dict | None = None) -> bool:
    """Whether `key` satisfies a `propertyNames` schema, its references read in the root's `defs`
    (`{"$defs": ...}`); one that cannot be read so is taken as satisfied."""
    import jsonschema

    try:
        return jsonschema.Draft202012Validator({**defs, **names} if defs and isinstance(names, dict) else names
                                               ).is_valid(key)
    except Exception:  # noqa: BLE001 (jsonschema's reference errors are several classes of `referencing`)
        return True


def finite(root: Any, refuse: Refuse) -> Any:
    """`root` without the ways into a recursion that never ends: an optional property,
    `additionalProperties` or `patternProperties` schema that no finite JSON value satisfies (every way
    through them refers back into themselves: a required key, the keys minProperties asks for, an item
    minItems asks for or every branch) is false. The grammar built from them let the model start such a
    value and never finish it (the reply cut at max_tokens, not JSON). The same goes for what nothing
    satisfies for other reasons (`false`, bounds past each other, which the compiler refused), and
    `anyOf`/`oneOf` branches nothing satisfies are left out, an array's length stops before such an item
    (`_array_bounded`). `refuse` when nothing finite satisfies `root` itself and recursion is why (else the
    checks after say what). References are local (checked before)."""
    if not isinstance(root, dict):
        return root
    targets = {n["$ref"]: resolve(root, n["$ref"]) for _, n in schemas(root) if isinstance(n.get("$ref"), str)}
    users: dict[str, set[str]] = {ref: set() for ref in targets}  # ref -> the refs whose targets mention it
    for ref, target in targets.items():
        for mentioned in _mentions(target):
            users[mentioned].add(ref)
    good: set[str] = set()
    work = list(targets)
    while work:  # the least fixed point: a reference is good once its target is, given the good ones so far;
        ref = work.pop()  # a target is looked at again only when a reference it mentions turns good
        if ref not in good and _Finite(good)(targets[ref]):
            good.add(ref)
            work.extend(users[ref] - good)
    seen = _Finite(good)
    # (a root nothing satisfies with every reference good fails for another reason: the checks after say why)
    if not seen(root) and _Finite(set(targets))(root):
        refuse("no finite JSON value matches the schema: every way through it refers back into itself (through "
               "a required key, the keys minProperties asks for, an item minItems asks for, or every branch of an "
               "anyOf); give the recursion a way to end, such as an optional property or a branch without it")
    return _finite_parts(root, seen)


def schemas(node: Any, path: str = "", defs: bool = True) -> Iterator[tuple[str, dict]]:
    """Every subschema of `node` that is an object, with its JSON pointer (`defs`: those under `$defs`
    too)."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict) and (defs or key not in _DEFS):
            for name, sub in node[key].items():
                yield from schemas(sub, f"{path}/{key}/{name}", defs)
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(node[key]) if isinstance(node.get(key), list) else ():
            yield from schemas(sub, f"{path}/{key}/{i}", defs)
    for key in SCHEMA_VALUES:
        yield from schemas(node.get(key), f"{path}/{key}", defs)


def _mentions(node: Any) -> set[str]:
    """The references in the value constraints of `node` (not in definitions it holds)."""
    return {n["$ref"] for _, n in schemas(node, defs=False) if isinstance(n.get("$ref"), str)}


class _Finite:
    """Whether some finite JSON value satisfies a subschema, the references in `good` taken as satisfiable
    and the others as not; remembered per subschema. Over-approximated wherever unsure (True), so that only
    what surely never ends, or is satisfied by nothing, is left out."""

    def __init__(self, good: set[str]) -> None:
        self.good = good
        self._known: dict[int, bool] = {}

    def __call__(self, node: Any) -> bool:
        if not isinstance(node, dict):
            return node is not False
        known = self._known.get(id(node))
        if known is None:
            known = self._known[id(node)] = self._of(node)
        return known

    def _of(self, node: dict) -> bool:
        if isinstance(node.get("$ref"), str) and node["$ref"] not in self.good:
            return False
        if isinstance(node.get("allOf"), list) and not all(map(self, node["allOf"])):
            return False
        if any(isinstance(node.get(k), list) and not any(map(self, node[k])) for k in ("anyOf", "oneOf")):
            return False
        if "enum" in node or "const" in node:
            return not _impossible(node)  # (its values are finite; bounds are checked per kind below)
        kinds = node.get("type", "any")
        return any(self.kind(node, kind) for kind in (kinds if isinstance(kinds, list) else [kinds]))

    def kind(self, node: dict, kind: Any) -> bool:
        """Whether some finite value of `kind` satisfies `node`'s keywords for it (its bounds, its object or array
        keywords)."""
        if isinstance(kind, str) and kind != "any" and _impossible({**node, "type": kind}):
            return False
        if kind == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
            extra = node.get("additionalProperties", True)
            required = node.get("required") if isinstance(node.get("required"), list) else []

            def value(key: str) -> Any:  # the schema of a key's value
                if key in props:
                    return props[key]
                return next((sub for p, sub in patterns.items() if search(p, key)), extra)

            if not all(self(value(k)) for k in required):
                return False
            least = node.get("minProperties", 0) if isinstance(node.get("minProperties"), int) else 0
            free = self(extra) or any(map(self, patterns.values()))  # keys of any name (over-approximated)
            return least == 0 or free or least <= sum(map(self, props.values()))
        if kind == "array":
            need = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            return all(map(self, prefix[:need])) and (need <= len(prefix) or self(node.get("items", True)))
        return True


def _finite_parts(node: Any, seen: _Finite) -> Any:
    """`node` with its optional parts that no finite value satisfies left out (see `finite`). A node nothing
    finite satisfies is left as it is: nothing refers to it any more but definitions like it, which the
    checks after read as they were written."""
    if not isinstance(node, dict) or not seen(node):
        return node
    out = dict(node)
    if isinstance(out.get("type"), list) and "enum" not in out and "const" not in out:
        kinds = [k for k in out["type"] if seen.kind(node, k)]  # `["object", "null"]`: null if no object ends
        out["type"] = kinds or out["type"]
    for key in ("anyOf", "oneOf"):  # (a branch nothing satisfies adds nothing: the compiler refused `false`)
        if isinstance(out.get(key), list) and any(map(seen, out[key])):
            out[key] = [s for s in out[key] if seen(s)]
    # an optional property nothing finite satisfies is false where the object takes no other keys (in an open
    # one the grammar could write it as another key, so a false property there is refused: it is left as it
    # was); a required one is refused by the checks after
    closed = out.get("additionalProperties", True) is False or not any(k in out for k in OPEN_BY_DESIGN)
    if isinstance(out.get("properties"), dict) and closed:
        required = out.get("required") if isinstance(out.get("required"), list) else []
        out["properties"] = {k: s if k in required or seen(s) else False for k, s in out["properties"].items()}
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {p: s if seen(s) else False for p, s in out["patternProperties"].items()}
    if isinstance(out.get("additionalProperties"), dict) and not seen(out["additionalProperties"]):
        out["additionalProperties"] = False
    if any(k in out for k in ("prefixItems", "items", "maxItems")):
        _array_bounded(out, seen)
    return _subschemas_mapped(out, lambda sub: _finite_parts(sub, seen))


def _array_bounded(out: dict, seen: _Finite) -> None:
    """An array's items from the first one nothing satisfies on left out (its length stops before it), and
    `prefixItems` past `maxItems` too, with `true` ones as `{}`: the compiler refused `false` and `true`
    there and more prefixItems than maxItems, whatever the arrays they allow."""
    prefix = list(out["prefixItems"]) if isinstance(out.get("prefixItems"), list) else []
    limit = out.get("maxItems") if isinstance(out.get("maxItems"), int) else None
    stop = next((i for i, s in enumerate(prefix) if not seen(s)), None)
    if stop is None and not seen(out.get("items", True)):
        stop = len(prefix)
    if stop is not None:  # (minItems is at most `stop` where an array is satisfiable)
        limit = stop if limit is None else min(limit, stop)
        out["maxItems"] = limit
    if limit is not None and limit <= len(prefix):
        out.pop("items", None)  # (no item past prefixItems: the compiler read its schema all the same)
    if "prefixItems" in out and isinstance(out["prefixItems"], list):
        prefix = [{} if s is True else s for s in prefix[:limit]]
        if prefix:
            out["prefixItems"] = prefix
        else:
            del out["prefixItems"]
