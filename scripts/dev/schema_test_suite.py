"""How much of JSON Schema our structured outputs get right: the JSON-Schema-Test-Suite (draft 2020-12) run against
the grammar the CPU engine builds for a client's schema, alone and with the check every answer gets after generation.

The suite (github.com/json-schema-org/JSON-Schema-Test-Suite, pinned at 44401e0c046704b476ec9d2e2fccdaee618f259d,
SUITE_COMMIT: the version the numbers reported were made from) holds, per keyword file, cases: a schema and instances
of it, each marked valid or not. Each case's schema goes through the gateway's `pipeline.serving.schemas.prepare`, as
for a request without `strict`; its `grammar_schema` is compiled by the engine's own `Grammars` (guided.py: the
engine's tokenizer, JSON layout and limits), once per case. Refused: the instances of a case that `prepare` or the
compile refuses (a ValueError, as the client would get a 400). Not applicable: those of a case whose whole schema is
`true` or `false` (`prepare` takes objects, as a request's schema is one), or whose refusal names a document of the
suite's remotes/ (http://localhost:1234/, which the suite expects served; nothing here serves it). optional/format
(format as an assertion) gets a table of its own; the suite's other optional/ files are left out.

An instance is written as the engine writes JSON (`json.dumps(data, ensure_ascii=False)`: one line, ", " and ": "),
tokenized with the engine's tokenizer (`tokenize_str`) and fed to a fresh copy of the compiled matcher: the grammar
accepts it when every token is consumed and the matcher is then accepting. Token by token, because that is how the
engine advances the matcher (one sampled token after another, each masked first): a valid instance the matcher refuses
on the way is an answer the model can never give. llguidance matches each token's bytes, so the verdict is the
language's, not one tokenization's (checked on this suite: one token per byte gave the same verdict everywhere).

Key order: the grammar writes an object's named properties in an order its schema fixes (`properties` as listed, with
those of allOf members and `$ref` targets merged in) and other properties after them, and takes no other order
(measured: for `{"properties": {"b": {}, "a": {}}}` it rejects `{"a": 1, "b": 2}` and accepts `{"b": 2, "a": 1}`; a
`const` object only in the order written). The suite's instances are JSON values, whose key order means nothing, and
reordering to one schema's order would miss anyOf branches that list the same names in other orders; so an instance
counts as accepted when some order of its keys is: the matcher picks it, key by key (`orders`, the instance's own
order tried first), and the text so found is then fed whole, as above.

Two pass rates, each over the instances the grammar was run on (tests less refused and not applicable):
* grammar: accepted exactly when valid. Lowered where a keyword is left out of the grammar (`relaxed`: the instances
  it forbids are accepted), where objects that name properties are closed (the gateway's default, not JSON Schema's:
  valid instances with other properties are rejected), where `format`, an annotation in 2020-12, is enforced, and
  where the grammar writes a value otherwise than `json.dumps` (an integer-valued 1.0 only as 1).
* grammar + check: what the client is told. A rejected instance is invalid; an accepted one is what
  `PreparedSchema.check` (jsonschema on the whole schema) says, its `valid: None` (unjudged) a failure. It is above
  the grammar's rate by what the check catches; a valid instance the grammar rejects fails both.
Under the table: the keywords of lowest grammar pass rate, each with its first failing test and why.

Usage, with a copy of the suite at SUITE_COMMIT (from a clone, or the mirror's git directory):

    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite jsts
    git -C jsts checkout 44401e0c046704b476ec9d2e2fccdaee618f259d
    .venv/bin/python scripts/dev/schema_test_suite.py --data jsts --output /tmp/schema_test_suite.md
    .venv/bin/python scripts/dev/schema_test_suite.py --data jsts --keyword items oneOf   # a few keywords
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import llguidance

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.bench.report import markdown_table  # noqa: E402
from pipeline.serving.schemas import PreparedSchema, prepare  # noqa: E402
from pipeline.targets.onnxruntime.runtime.guided import Grammars, Guide, one_line  # noqa: E402
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner  # noqa: E402

SUITE = "json-schema-org/JSON-Schema-Test-Suite"
SUITE_COMMIT = "44401e0c046704b476ec9d2e2fccdaee618f259d"
DRAFT = Path("tests/draft2020-12")
FORMATS = DRAFT / "optional" / "format"  # format as an assertion: checked by the grammar and by `check`
REMOTES = "http://localhost:1234/"  # the suite serves remotes/ there; a refusal naming a resource there: not applicable
DEFAULT_ENGINE = REPO / "artifacts" / "smollm2-135m-cpu" / "engine"
LOWEST = 5  # keywords listed under the table, each with a failing example
TEXT_CHARS = 80
HEADERS = ["keyword", "cases", "tests", "refused", "not applicable", "grammar pass", "grammar + check pass"]


@dataclass
class Tally:
    """One keyword file's counts, and its first failure of the grammar alone (for the list under the table)."""

    name: str
    cases: int = 0
    tests: int = 0
    refused: int = 0
    not_applicable: int = 0
    grammar_passed: int = 0
    checked_passed: int = 0
    failure: str = ""

    @property
    def applicable(self) -> int:
        return self.tests - self.refused - self.not_applicable

    def rate(self, passed: int) -> str:
        return f"{passed / self.applicable:.1%}" if self.applicable else "n/a"

    def row(self) -> list:
        counts = [self.cases, self.tests, self.refused, self.not_applicable]
        return [self.name, *counts, self.rate(self.grammar_passed), self.rate(self.checked_passed)]

    def add(self, other: Tally) -> None:
        for name in ("cases", "tests", "refused", "not_applicable", "grammar_passed", "checked_passed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def fed(matcher: llguidance.LLMatcher, text: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher | None:
    """A copy of `matcher` that consumed `text`'s tokens; None when the grammar rejects one."""
    copy = matcher.deep_copy()
    return copy if copy.consume_tokens(tokenizer.tokenize_str(text)) else None


Written = Iterator[tuple[str, llguidance.LLMatcher]]  # (text, the matcher that consumed it) for each way taken


def orders(matcher: llguidance.LLMatcher, value: Any, tokenizer: llguidance.LLTokenizer) -> Written:
    """`value` as the grammar writes JSON, once per order of its objects' keys that the grammar takes (the value's
    own order first): the matcher prunes the orders key by key, so few are tried."""
    if isinstance(value, dict):
        for opened, matcher in _literal(matcher, "{", tokenizer):
            for rest, after in _members(matcher, value, True, tokenizer):
                yield opened + rest, after
    elif isinstance(value, list):
        for opened, matcher in _literal(matcher, "[", tokenizer):
            for rest, after in _items(matcher, value, 0, tokenizer):
                yield opened + rest, after
    else:
        yield from _literal(matcher, json.dumps(value, ensure_ascii=False), tokenizer)


def _literal(matcher: llguidance.LLMatcher, text: str, tokenizer: llguidance.LLTokenizer) -> Written:
    after = fed(matcher, text, tokenizer)
    if after is not None:
        yield text, after


def _members(matcher: llguidance.LLMatcher, rest: dict, first: bool, tokenizer: llguidance.LLTokenizer) -> Written:
    if not rest:
        yield from _literal(matcher, "}", tokenizer)
        return
    for key, value in rest.items():
        head = ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        others = {k: v for k, v in rest.items() if k != key}
        for _, started in _literal(matcher, head, tokenizer):
            for text, matcher_after_value in orders(started, value, tokenizer):
                for tail, after in _members(matcher_after_value, others, False, tokenizer):
                    yield head + text + tail, after


def _items(matcher: llguidance.LLMatcher, items: list, index: int, tokenizer: llguidance.LLTokenizer) -> Written:
    if index == len(items):
        yield from _literal(matcher, "]", tokenizer)
        return
    for head, started in _literal(matcher, ", " if index else "", tokenizer):
        for text, matcher_after_item in orders(started, items[index], tokenizer):
            for tail, after in _items(matcher_after_item, items, index + 1, tokenizer):
                yield head + text + tail, after


def accepted_text(matcher: llguidance.LLMatcher, data: Any, tokenizer: llguidance.LLTokenizer) -> str | None:
    """The instance as the grammar accepts it, fed whole in its canonical tokens (the first order of its keys that
    passes); None when the grammar rejects it in every order."""
    for text, _ in orders(matcher, data, tokenizer):
        after = fed(matcher, text, tokenizer)
        if after is not None and after.is_accepting():
            return text
    return None


def rejection(matcher: llguidance.LLMatcher, data: Any, tokenizer: llguidance.LLTokenizer) -> str:
    """Why the grammar rejects the instance as written: llguidance's error, or that it stops short of accepting."""
    after = matcher.deep_copy()
    after.consume_tokens(tokenizer.tokenize_str(json.dumps(data, ensure_ascii=False)))
    return one_line(after.get_error()) if after.is_error() else "the grammar wants more"


def run_case(case: dict, grammars: Grammars, tally: Tally) -> None:
    """Count one case's tests into `tally`."""
    tests = case["tests"]
    tally.cases += 1
    tally.tests += len(tests)
    if isinstance(case["schema"], bool):
        tally.not_applicable += len(tests)
        return
    try:
        prepared = prepare(case["schema"], strict=False)
        start = grammars.matcher(Guide("json_schema", json.dumps(prepared.grammar_schema)))
    except ValueError as exc:
        if f"Resource '{REMOTES}" in str(exc):
            tally.not_applicable += len(tests)
        else:
            tally.refused += len(tests)
        return
    for test in tests:
        text = accepted_text(start, test["data"], grammars.tokenizer)
        tally.grammar_passed += (text is not None) == test["valid"]
        tally.checked_passed += verdict(prepared, text) == test["valid"]
        if (text is not None) != test["valid"] and not tally.failure:
            tally.failure = failure(case, test, prepared, text, start, grammars.tokenizer)


def verdict(prepared: PreparedSchema, text: str | None) -> bool | None:
    """What the client is told: an instance the grammar rejects is invalid, an accepted one is as the check says."""
    return False if text is None else prepared.check(text)["valid"]


def failure(
    case: dict,
    test: dict,
    prepared: PreparedSchema,
    text: str | None,
    start: llguidance.LLMatcher,
    tokenizer: llguidance.LLTokenizer,
) -> str:
    """A failing test as the list under the table shows it: where, the instance, and why the grammar got it wrong."""
    instance = json.dumps(test["data"], ensure_ascii=False)
    if len(instance) > TEXT_CHARS:
        instance = instance[:TEXT_CHARS] + "..."
    where = f"{case['description']} / {test['description']}: `{instance}`"
    if text is None:
        return f"{where}: rejected though valid ({rejection(start, test['data'], tokenizer)})"
    return f"{where}: accepted though invalid (left out of the grammar: {', '.join(prepared.relaxed) or 'nothing'})"


def run_file(path: Path, name: str, grammars: Grammars) -> Tally:
    tally = Tally(name)
    for case in json.loads(path.read_text(encoding="utf-8")):
        run_case(case, grammars, tally)
    return tally


def table(tallies: list[Tally]) -> str:
    total = Tally("total")
    for tally in tallies:
        total.add(tally)
    return markdown_table(HEADERS, [tally.row() for tally in [*tallies, total]])


def lowest(tallies: list[Tally]) -> str:
    """The LOWEST keywords by the grammar's pass rate, each with its first failing instance and why."""
    failing = sorted((t for t in tallies if t.failure), key=lambda t: (t.grammar_passed / t.applicable, t.name))
    return "\n".join(f"* {t.name} ({t.rate(t.grammar_passed)}): {t.failure}" for t in failing[:LOWEST])


def report(keywords: list[Tally], formats: list[Tally], engine: Path, seconds: float) -> str:
    parts = [
        f"JSON-Schema-Test-Suite ({SUITE} at {SUITE_COMMIT}), draft 2020-12, against the grammar of "
        f"`prepare(schema, strict=False)` compiled for {engine}. Pass rates are over the tests the grammar was run "
        "on (neither refused nor not applicable); not applicable: a boolean schema (`true` / `false` as the whole "
        "schema) or one that needs the suite's remotes. The grammar's verdict ignores key order (the engine writes "
        "keys in the schema's order).",
        "",
        table(keywords),
        "",
        f"Lowest grammar pass rates (the first failing test of each):\n\n{lowest(keywords) or '* none'}",
    ]
    if formats:
        parts += ["", "optional/format (format as an assertion):", "", table(formats)]
    return "\n".join([*parts, "", f"Elapsed: {seconds:.1f} s"]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data", type=Path, required=True, metavar="DIR", help=f"a copy of {SUITE} at SUITE_COMMIT (holding {DRAFT}/)"
    )
    parser.add_argument(
        "--engine",
        type=Path,
        default=DEFAULT_ENGINE,
        metavar="DIR",
        help="the CPU engine whose tokenizer and grammar limits are used (default: %(default)s)",
    )
    parser.add_argument(
        "--keyword",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="only these keyword files (their names without .json, e.g. items oneOf); optional/format is then skipped",
    )
    parser.add_argument("--output", type=Path, metavar="FILE.md", help="also write the report (markdown) here")
    args = parser.parse_args()
    if not (args.data / DRAFT).is_dir():
        parser.error(f"--data {args.data}: no {DRAFT}/ there (see --help for how to get the suite)")
    started = time.perf_counter()
    try:  # the engine's guides as its runner compiles them: its tokenizer, end id, vocabulary and max_seq_len
        grammars = ModelRunner.from_dir(args.engine, num_threads=1).grammars
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"--engine {args.engine}: {exc}")
    files = sorted((args.data / DRAFT).glob("*.json"))
    if args.keyword:
        unknown = set(args.keyword) - {path.stem for path in files}
        if unknown:
            parser.error(f"--keyword: no such file in {DRAFT}: {', '.join(sorted(unknown))}")
        files = [path for path in files if path.stem in args.keyword]
    format_files = [] if args.keyword else sorted((args.data / FORMATS).glob("*.json"))
    keywords, formats = [], []
    for path in files + format_files:
        name = path.stem if path.parent == args.data / DRAFT else f"optional/format/{path.stem}"
        tally = run_file(path, name, grammars)
        (keywords if path in files else formats).append(tally)
        print(f"{name}: {tally.tests} tests, {time.perf_counter() - started:.1f} s", file=sys.stderr)
    text = report(keywords, formats, args.engine, time.perf_counter() - started)
    print(text, end="")
    if args.output:
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
