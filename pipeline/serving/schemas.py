"""JSON schemas for structured outputs: what the grammar is given (`prepare`), and each answer checked against the
client's schema (`PreparedSchema.check`).

Real-world schemas use keywords no token grammar enforces (`uniqueItems`, `not`, `dependentRequired`, ...). OpenAI's
`strict: false`, its default, asks for best effort, so a schema is refused only with `strict: true`: otherwise the
grammar enforces what it can, the keywords it cannot are left out of it (`relaxed`), and the answer is validated
with `jsonschema` after generation, the result in the response (`structured_output`), never silently. What the
grammar can enforce is what llguidance, the CPU engine's grammar compiler (and one of TensorRT-LLM's two), compiles:
the schema is compiled here without a tokenizer, and each keyword it names as unimplemented is left out in turn.

An object schema that names its properties and does not say whether others are allowed is closed
(`additionalProperties: false`), as OpenAI's strict mode requires (platform.openai.com/docs/guides/structured-outputs,
"additionalProperties: false must always be set"), xgrammar's strict mode assumes (mlc-ai/xgrammar
python/xgrammar/grammar.py at 53da3ff8c0db359ecb6d4b41f154308c82a89aaf: `strict_mode`, default true, allows no
property the schema does not name) and llama.cpp's converter assumes (ggml-org/llama.cpp
common/json-schema-to-grammar.cpp at 011c6c3c305634c65886cf7f32805907f667590c: `_build_object_rule` adds unnamed
properties only for `additionalProperties` true or a schema): with JSON Schema's own default (open) a small model
invents properties until `max_tokens`.
`additional_properties_default=True` keeps JSON Schema's default. Strings and numbers the schema does not bound are
bounded in the grammar (`bound_strings`, `bound_numbers`) for the same reason. Each of these narrows the grammar
only: answers are always checked against the schema as the client wrote it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import jsonschema
import llguidance
from jsonschema.exceptions import SchemaError, relevance

# Keywords whose value holds subschemas, by shape (JSON Schema 2020-12, with draft 4-7's spellings).
ONE_SCHEMA = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# Keywords that say what an object's unnamed properties may be: an object with any of them is not closed.
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords about an object's properties: beside anyOf / oneOf, they meet each branch's in one object.
OBJECT_KEYWORDS = ("properties", "required", *OPEN_KEYWORDS, "minProperties", "maxProperties", "propertyNames")
# 16 digits at most, as llama.cpp's `integral-part` (its converter, at the commit above); the largest integer a float
# holds exactly with its neighbours (I-JSON, RFC 7493 section 2.2), since llguidance reads bounds as floats
NUMBER_BOUND = 2**53 - 1
STRING_BOUND = 256  # characters
# Keywords that say nothing of an instance's validity, and groups of keywords that read each other (an allOf member
# moves into its parent only where no group has keywords on both sides)
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "deprecated"})
INTERACTING = (
    frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}),
    frozenset(
        {"prefixItems", "items", "additionalItems", "unevaluatedItems", "contains", "minContains", "maxContains"}
    ),
    frozenset({"if", "then", "else"}),
)
# Keywords whose value is a non-negative integer, which JSON Schema lets be written 2.0
COUNTS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains", "maxContains"}
)
# The llguidance options (`x-guidance`) a client may set, and the values that keep the answer JSON: how it is laid out,
# nothing of what is enforced. A whitespace pattern of the client's own could admit any text between tokens.
LAYOUT_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "whitespace_flexible": lambda value: isinstance(value, bool),
    "whitespace_pattern": lambda value: value is None,
    "item_separator": lambda value: isinstance(value, str) and re.fullmatch(r"[ \t\n\r]*,[ \t\n\r]*", value),
    "key_separator": lambda value: isinstance(value, str) and re.fullmatch(r"[ \t\n\r]*:[ \t\n\r]*", value),
}
LAYOUT_RULES = {
    "whitespace_flexible": "true or false",
    "whitespace_pattern": "null only: it drops the engine's own",
    "item_separator": "a comma within JSON whitespace",
    "key_separator": "a colon within JSON whitespace",
}
RELAX_ROUNDS = 16  # each round leaves out what one compile named; real schemas need two or three
ERRORS_SHOWN = 3
ERROR_CHARS = 240


def subschemas(schema: dict) -> Iterator[dict]:
    """The schema objects directly inside `schema` (not its data: `enum`, `const`, `default`, `examples`)."""
    for keyword in ONE_SCHEMA:
        if isinstance(schema.get(keyword), dict):
            yield schema[keyword]
    for keyword in SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            yield from (item for item in schema[keyword] if isinstance(item, dict))
    for keyword in SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            yield from (item for item in schema[keyword].values() if isinstance(item, dict))


def every_schema(root: dict, enter: Callable[[dict], bool] = lambda schema: True) -> Iterator[dict]:
    """`root` and every schema object inside it, each once: those at the keywords' places, and those a local `$ref`
    points at wherever they are (a `$defs` entry, or any place in the document); none that `enter` refuses, nor
    what is inside it."""
    seen, stack = set(), [root]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(sub for sub in subschemas(current) if enter(sub))
        target = local_target(root, current.get("$ref"))
        if target is not None and enter(target):
            stack.append(target)


def local_target(root: dict, ref: str) -> dict | None:
    """The schema a local `$ref` ("#/$defs/x") points at in `root`; None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target: Any = root
    for part in filter(None, urllib.parse.unquote(ref[1:]).split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target if isinstance(target, dict) else None


def members(schema: dict, keywords=("allOf", "anyOf", "oneOf")) -> list[dict]:
    return [m for k in keywords if isinstance(schema.get(k), list) for m in schema[k] if isinstance(m, dict)]


def targets(root: dict, ref, named: list[dict]) -> list[dict]:
    """What a `$ref` may point at: the schema at its JSON pointer, or, for one by `$anchor` or `$id` (resolved
    against base URIs this does not follow), every schema that has one (`named`)."""
    if not isinstance(ref, str):
        return []
    if ref.startswith("#/") or ref == "#":
        target = local_target(root, ref)
        return [target] if target is not None else []
    return named


def intersected(root: dict) -> set[int]:
    """The schemas whose properties may meet another schema's in one object: allOf members, a `$ref` beside other
    keys, anyOf / oneOf branches beside properties, and, from each, everything inside it (the same property of two
    members meets too) and what it refers to. Closing one of them could forbid what the other allows."""
    pending: list[dict] = []
    named = [schema for schema in every_schema(root) if "$anchor" in schema or "$id" in schema]
    for schema in every_schema(root):
        beside_branches = members(schema, ("anyOf", "oneOf")) and any(k in schema for k in OBJECT_KEYWORDS)
        if "allOf" in schema or ("$ref" in schema and len(schema) > 1) or beside_branches:
            pending.append(schema)
    combined: set[int] = set()
    while pending:
        schema = pending.pop()
        if id(schema) in combined:
            continue
        combined.add(id(schema))
        pending.extend(subschemas(schema))
        pending.extend(targets(root, schema.get("$ref"), named))
    return combined


def mergeable(parent: dict, member: dict) -> bool:
    """Whether an allOf member can move into its parent and mean the same: they share no keyword, no keyword of
    either reads one of the other's (the groups below), and nothing moves that a `$ref` or base URI may name."""
    own = parent.keys() - ANNOTATIONS - {"allOf"}
    theirs = member.keys() - ANNOTATIONS
    if own & theirs or theirs & {"$ref", "$id", "$anchor", "$defs", "definitions", "$dynamicAnchor"}:
        return False
    return not any(own & group and theirs & group for group in INTERACTING)


def merge_all_of(root: dict) -> None:
    """In place: an allOf whose members can all move into their parent where that means the same (`mergeable`) is
    dissolved, so that a wrapper such as `{"type": "object", "allOf": [{"properties": ...}]}` is one object schema
    that can be closed. A partial merge would reorder properties (the grammar writes the parent's after the
    members'), and nothing moves when a `$ref` points inside an allOf, which moving would break."""
    if any("/allOf/" in str(schema.get("$ref", "")) for schema in every_schema(root)):
        return
    for schema in list(every_schema(root)):
        if not isinstance(schema.get("allOf"), list):
            continue
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for member in schema["allOf"]:
            if not (isinstance(member, dict) and mergeable(merged, member)):
                break
            merged.update({k: v for k, v in member.items() if k not in ANNOTATIONS or k not in merged})
        else:
            schema.clear()
            schema.update(merged)


def close_objects(root: dict) -> None:
    """In place: every object schema that names properties and says nothing of others gets
    `additionalProperties: false`, but where its properties meet another schema's (`intersected`) or it requires
    one it does not name."""
    combined = intersected(root)
    for schema in every_schema(root):
        named = schema.get("properties")
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        names_all = isinstance(named, dict) and all(name in named for name in required)
        if names_all and id(schema) not in combined and not any(k in schema for k in OPEN_KEYWORDS):
            schema["additionalProperties"] = False


def bound_numbers(root: dict) -> None:
    """In place: a number with no bound on a side gets NUMBER_BOUND there, as llama.cpp's converter writes numbers
    of 16 digits at most (`integral-part`): a small model otherwise writes digits until `max_tokens`. The grammar
    narrows; the answer is still checked against the schema as written."""
    for schema in every_schema(root):
        types = schema.get("type")
        numeric = types in ("integer", "number") or (isinstance(types, list) and {"integer", "number"} & set(types))
        if not numeric or "enum" in schema or "const" in schema:
            continue
        given = [schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= NUMBER_BOUND for v in given):
            continue
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -NUMBER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = NUMBER_BOUND


def bound_strings(root: dict) -> None:
    """In place: a string with no bound on its length gets STRING_BOUND characters at most, so that a small model
    caught repeating itself inside one is made to close it (measured on JSONSchemaBench: most unfinished answers end
    inside a string). The grammar narrows; the answer is still checked against the schema as written."""
    for schema in every_schema(root):
        types = schema.get("type")
        textual = types == "string" or (isinstance(types, list) and "string" in types)
        if textual and not {"maxLength", "enum", "const", "format", "pattern"} & schema.keys():
            least = schema.get("minLength")
            schema["maxLength"] = STRING_BOUND + (least if isinstance(least, int) else 0)


def grammar_options(root: dict) -> None:
    """In place: each `$schema` llguidance does not know (it would try to fetch it) left out of the grammar, which
    reads JSON Schema alike in every draft; ValueError for llguidance options (`x-guidance`) other than a JSON layout,
    such as `lenient`, which would let it leave out what `strict` and `relaxed` are meant to account for, or a
    separator or whitespace pattern that would make the answer something other than JSON."""
    for schema in every_schema(root):
        if isinstance(schema.get("$schema"), str) and grammar_refusal({"$schema": schema["$schema"]}):
            del schema["$schema"]
    options = root.get("x-guidance", {})
    if not isinstance(options, dict):
        raise ValueError("x-guidance: an object of llguidance's layout options")
    taken = ", ".join(sorted(LAYOUT_OPTIONS))
    others = sorted(options.keys() - LAYOUT_OPTIONS)
    if others:
        raise ValueError(f"x-guidance: only {taken} are taken, not {', '.join(others)}")
    for name, value in options.items():
        if not LAYOUT_OPTIONS[name](value):
            raise ValueError(f"x-guidance: {name} {json.dumps(value)[:80]} is not taken ({LAYOUT_RULES[name]})")


def whole_counts(root: dict) -> None:
    """In place: a count written as a decimal (`"maxItems": 2.0`) as the integer it is, which JSON Schema allows
    and llguidance refuses."""
    for schema in every_schema(root):
        for keyword in COUNTS & schema.keys():
            value = schema[keyword]
            if isinstance(value, float) and value.is_integer():
                schema[keyword] = int(value)


def drop_keywords(root: dict, keywords: set[str]) -> None:
    for schema in every_schema(root):
        for keyword in keywords & schema.keys():
            del schema[keyword]


def uncountable(schema: dict) -> bool:
    """Whether llguidance may refuse to count this object's properties: it counts where every named property is
    required, or a closed object's up to 1."""
    named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if all(name in required for name in named):
        return False
    bounds = [schema.get(k, 0) for k in ("minProperties", "maxProperties")]
    return schema.get("additionalProperties") is not False or any(b > 1 for b in bounds if isinstance(b, int))


def drop_property_counts(root: dict) -> list[str]:
    """min/maxProperties left out of the objects llguidance may not count (`uncountable`; of every object where
    none is), the ones left out named for the client."""
    counted = [schema for schema in every_schema(root) if {"minProperties", "maxProperties"} & schema.keys()]
    dropped = [schema for schema in counted if uncountable(schema)] or counted
    found = [k for k in ("minProperties", "maxProperties") if any(k in schema for schema in dropped)]
    for schema in dropped:
        schema.pop("minProperties", None)
        schema.pop("maxProperties", None)
    return found


def drop_unknown_formats(root: dict) -> list[str]:
    """Every `format` llguidance does not know left out at once (a schema may use many), named for the client."""
    dropped = []
    unknown = functools.cache(lambda name: bool(grammar_refusal({"type": "string", "format": name})))
    for schema in every_schema(root):
        name = schema.get("format")
        if isinstance(name, str) and unknown(name):
            del schema["format"]
            dropped += [f"format {name}"] if f"format {name}" not in dropped else []
    return dropped


def one_of_as_any_of(root: dict) -> None:
    """oneOf as anyOf: exact where the branches exclude each other, the output validated where they do not. A `$ref`
    that points inside a oneOf is pointed first at a copy of its target in `$defs`, which the change cannot move."""
    pinned = root.setdefault("$defs", {}) if isinstance(root.get("$defs", {}), dict) else None
    for schema in list(every_schema(root)):
        ref = schema.get("$ref")
        if pinned is not None and isinstance(ref, str) and "/oneOf/" in ref and local_target(root, ref) is not None:
            name = f"oneOf-branch-{len(pinned)}"
            pinned[name] = copy.deepcopy(local_target(root, ref))
            schema["$ref"] = f"#/$defs/{name}"
    if pinned == {}:
        del root["$defs"]
    for schema in every_schema(root):
        if "oneOf" in schema:
            branches = schema.pop("oneOf")
            if "anyOf" in schema:  # both: the answer must match one of each
                schema["allOf"] = [*schema.get("allOf", []), {"anyOf": branches}]
            else:
                schema["anyOf"] = branches


def drop_ref(root: dict, ref: str) -> None:
    """Every `$ref` to `ref` left out (the keys beside it stay): llguidance cannot intersect a recursive reference
    with keys beside it, whether beside the `$ref` or beside a combinator holding it."""
    for schema in every_schema(root):
        if schema.get("$ref") == ref:
            del schema["$ref"]


def drop_overlapping_patterns(root: dict) -> None:
    """Objects with several `patternProperties` lose them and any bound on unnamed properties: llguidance needs
    the patterns disjoint, and leaving them out must widen, not narrow, what is allowed."""
    for schema in every_schema(root):
        if isinstance(schema.get("patternProperties"), dict) and len(schema["patternProperties"]) > 1:
            del schema["patternProperties"]
            schema.pop("additionalProperties", None)


def drop_unbounded_bounds(root: dict) -> list[str]:
    """Number bounds beyond NUMBER_BOUND (1.8e308 often standing for "none") left out: llguidance builds a regular
    expression of every number in range and cannot for some of those."""
    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

    def beyond(schema: dict) -> list[str]:
        return [k for k in bounds if isinstance(schema.get(k), (int, float)) and abs(schema[k]) > NUMBER_BOUND]

    wide = [schema for schema in every_schema(root) if beyond(schema)]
    unranged = [s for s in wide if grammar_refusal({k: s[k] for k in ("type", *bounds) if k in s})] or wide
    return [f"{keyword} {schema.pop(keyword)}" for schema in unranged for keyword in beyond(schema)]


def pattern_refusal(pattern: str) -> str:
    return grammar_refusal({"type": "string", "pattern": pattern})


def drop_unparsed_patterns(root: dict) -> list[str]:
    """Each `pattern` llguidance's regex parser does not take (lookarounds, backreferences) left out; the
    patterns, for the client."""
    dropped = []
    for schema in every_schema(root):
        if isinstance(schema.get("pattern"), str) and pattern_refusal(schema["pattern"]):
            dropped.append(f"pattern {schema.pop('pattern')}")
    return dropped


def listed_keywords(match: re.Match) -> list[str]:
    return json.loads(f"[{match[1]}]")


@dataclass(frozen=True)
class Relaxation:
    """One kind of llguidance refusal: how it reads (a regular expression over its message) and how the schema is
    relaxed, in place, so that the grammar compiles without what it refused; `apply` returns what was left out, as
    the client is told."""

    pattern: str
    apply: Callable[[dict, re.Match], list[str]]


def _dropping(keywords: Callable[[re.Match], list[str]]) -> Callable[[dict, re.Match], list[str]]:
    def apply(root: dict, match: re.Match) -> list[str]:
        names = keywords(match)
        drop_keywords(root, set(names))
        return names

    return apply


def _with_name(name: Callable[[re.Match], str], relax: Callable[[dict, re.Match], None]):
    def apply(root: dict, match: re.Match) -> list[str]:
        relax(root, match)
        return [name(match)]

    return apply


# llguidance 1.9's refusals of a schema it cannot enforce (pinned in pyproject.toml; tests/serving/test_schemas.py
# holds one schema per refusal, so a release that words them otherwise fails there, not in production).
RELAXATIONS = (
    Relaxation(r"Unimplemented keys: \[(.*?)\]", _dropping(listed_keywords)),
    Relaxation(r"Unknown format", lambda root, m: drop_unknown_formats(root)),
    Relaxation(
        r"oneOf constraints are not supported", _with_name(lambda m: "oneOf", lambda root, m: one_of_as_any_of(root))
    ),
    Relaxation(r"min/maxProperties only supported", lambda root, m: drop_property_counts(root)),
    Relaxation(
        r"circular references with sibling keys are not supported: \S*?(#\S*)",
        _with_name(lambda m: f"$ref {m[1]} (recursive, beside other keys)", lambda root, m: drop_ref(root, m[1])),
    ),
    Relaxation(
        r"patternProperty regexes .* are not disjoint",
        _with_name(lambda m: "patternProperties (overlapping)", lambda root, m: drop_overlapping_patterns(root)),
    ),
    Relaxation(r"regex parse error", lambda root, m: drop_unparsed_patterns(root)),
    Relaxation(r"Failed to generate regex for float range", lambda root, m: drop_unbounded_bounds(root)),
)


def grammar_refusal(schema: dict) -> str:
    """llguidance's refusal of `schema` as a grammar, or "" when it compiles."""
    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except ValueError as exc:
        return str(exc)


@functools.cache
def enforced_formats() -> frozenset[str]:
    """The `format` values the grammar enforces and jsonschema can check: asserted after generation too (other
    formats are annotations, as JSON Schema has them)."""
    checkable = jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers
    return frozenset(f for f in checkable if not grammar_refusal({"type": "string", "format": f}))


@dataclass(frozen=True)
class PreparedSchema:
    """A client's `schema` as the grammar takes it (`grammar_schema`), the keywords left out of the grammar
    (`relaxed`), and the validator every answer is checked with."""

    schema: dict
    grammar_schema: dict
    relaxed: tuple[str, ...]
    validator: Any = field(repr=False)

    def check(self, text: str) -> dict:
        """The response's `structured_output`: whether `text` is valid for the client's schema, why not (the most
        relevant errors first), and what the grammar did not enforce."""
        report: dict[str, Any] = {"valid": False, "relaxed": list(self.relaxed)}
        try:
            instance = json.loads(text)
            errors = sorted(self.validator.iter_errors(instance), key=relevance)
        except json.JSONDecodeError as exc:
            return {**report, "errors": [f"not JSON ({exc.msg} at character {exc.pos}): unfinished at max_tokens?"]}
        except RecursionError:
            return {**report, "valid": None, "errors": ["not checked: nested deeper than the checker reads"]}
        except Exception as exc:  # noqa: BLE001 -- a reference or pattern jsonschema cannot read: say so, do not fail
            return {**report, "valid": None, "errors": [f"not checked: {exc}"[:ERROR_CHARS]]}
        if errors:
            report["errors"] = [f"{e.json_path}: {e.message}"[:ERROR_CHARS] for e in errors[:ERRORS_SHOWN]]
        report["valid"] = not errors
        return report


@functools.cache
def with_dependencies(cls):
    """`cls` with draft 4-7's `dependencies` where its draft has none: 2019-09 split the keyword in two and its
    meta-schema keeps it as deprecated, and schemas written for the older drafts use it without naming a draft. Unread,
    an answer the grammar was not asked to hold to it (it cannot) would be reported valid whatever it held."""
    if "dependencies" in cls.VALIDATORS:
        return cls
    return jsonschema.validators.extend(cls, {"dependencies": jsonschema.Draft7Validator.VALIDATORS["dependencies"]})


def validator_class(schema: dict):
    """The jsonschema validator of the schema's own `$schema` (draft 2020-12 without one), reading `dependencies`."""
    return with_dependencies(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))


def check_schema(cls, schema: dict) -> None:
    """SchemaError when `schema` is not a schema of `cls`'s draft. Its regexes are not held to Python's `re`: JSON
    Schema's are ECMA-262's (`\\p{Letter}` is one, which llguidance compiles and `re` refuses); an answer jsonschema
    then cannot check is reported unchecked (`PreparedSchema.check`)."""
    formats = jsonschema.FormatChecker(())
    formats.checkers = {name: check for name, check in cls.FORMAT_CHECKER.checkers.items() if name != "regex"}
    cls.check_schema(schema, format_checker=formats)


def validator(schema: dict, relaxed: tuple[str, ...]):
    """jsonschema's validator for the schema (`validator_class`), asserting the formats the grammar enforced;
    SchemaError when `schema` is not a schema of its draft."""
    cls = validator_class(schema)
    check_schema(cls, schema)
    formats = enforced_formats() - {name.removeprefix("format ") for name in relaxed}
    return cls(schema, format_checker=jsonschema.FormatChecker(formats))


def grammar_copy(schema: dict, additional_properties_default: bool, bounded: bool) -> dict:
    """The client's schema as the grammar is first given it: objects closed (unless the request keeps JSON Schema's
    default) and, when `bounded`, strings and numbers bounded."""
    grammar_schema = copy.deepcopy(schema)
    grammar_options(grammar_schema)
    whole_counts(grammar_schema)
    if not additional_properties_default:
        merge_all_of(grammar_schema)
        close_objects(grammar_schema)
    if bounded:
        bound_numbers(grammar_schema)
        bound_strings(grammar_schema)
    return grammar_schema


@functools.lru_cache(maxsize=64)
def _prepare(text: str, strict: bool, additional_properties_default: bool) -> PreparedSchema:
    schema = json.loads(text)
    try:
        check_first = validator(schema, ())
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}"[:400]) from None
    bounded = True
    grammar_schema = grammar_copy(schema, additional_properties_default, bounded)
    relaxed: list[str] = []
    for _ in range(RELAX_ROUNDS):
        refusal = grammar_refusal(grammar_schema)
        if not refusal:
            break
        if bounded and "Unsatisfiable schema" in refusal:  # our bounds may meet the schema's beside a $ref or allOf
            bounded, relaxed = False, []
            grammar_schema = grammar_copy(schema, additional_properties_default, bounded)
            continue
        found = next(((r, m) for r in RELAXATIONS if (m := re.search(r.pattern, refusal))), None)
        if found is None:
            raise ValueError(f"the grammar cannot be built: {' '.join(refusal.split())}"[:400])
        relaxation, match = found
        if strict:
            raise ValueError(
                f"the grammar cannot enforce this with strict: true ({' '.join(refusal.split())}); without strict, "
                "the rest is enforced and the answer is validated against the whole schema after generation"[:400]
            )
        names = relaxation.apply(grammar_schema, match)
        if not names:
            raise ValueError(f"the grammar cannot be built: {' '.join(refusal.split())}"[:400])
        relaxed += [name for name in names if name not in relaxed]
    else:
        raise ValueError(f"the grammar cannot be built after leaving out {', '.join(relaxed)}"[:400])
    checker = validator(schema, tuple(relaxed)) if relaxed else check_first
    return PreparedSchema(schema, grammar_schema, tuple(relaxed), checker)


def prepare(schema: dict, *, strict: bool, additional_properties_default: bool = False) -> PreparedSchema:
    """`schema` made ready for the grammar and for checking answers (the last 64 kept); ValueError, its message for
    the client, for a schema that is not one or, with `strict`, one the grammar cannot wholly enforce."""
    try:
        return _prepare(json.dumps(schema), strict, additional_properties_default)  # key order: the order written
    except RecursionError:
        raise ValueError("the schema is nested deeper than it can be read") from None
