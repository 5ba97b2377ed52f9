"""scripts/dev/schema_test_suite.py on cases written here in the suite's shape (a schema and tests of data and
validity), compiled for a byte-level tokenizer: the key-order search, what counts as refused and not applicable, the
two pass rates and the report."""

from __future__ import annotations

import pytest

from pipeline.targets.onnxruntime.runtime.guided import Grammars, Guide
from tests.conftest import dev_script
from tests.runtime.test_guided import byte_tokenizer

suite = dev_script("schema_test_suite")
B_THEN_A = {"properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Grammars:
    return Grammars(byte_tokenizer(tmp_path_factory.mktemp("tokenizer")), end_id=2, vocab_size=98, max_seq_len=512)


def accepted(grammars: Grammars, schema: dict, data) -> str | None:
    matcher = grammars.matcher(Guide("json_schema", suite.json.dumps(schema)))
    return suite.accepted_text(matcher, data, grammars.tokenizer)


def test_the_grammar_takes_keys_only_in_the_schemas_order_and_the_search_finds_it(grammars):
    matcher = grammars.matcher(Guide("json_schema", suite.json.dumps(B_THEN_A)))
    assert suite.fed(matcher, '{"a": 1, "b": 2}', grammars.tokenizer) is None
    assert accepted(grammars, B_THEN_A, {"a": 1, "b": 2}) == '{"b": 2, "a": 1}'
    assert accepted(grammars, {"items": B_THEN_A}, [{"a": 1}, {"a": 3, "b": 4}]) == '[{"a": 1}, {"b": 4, "a": 3}]'
    assert accepted(grammars, B_THEN_A, {"a": "x", "b": 2}) is None


def test_each_anyof_branch_is_met_in_its_own_order(grammars):
    a_then_b = {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    branches = {"anyOf": [{**B_THEN_A, "required": ["b"]}, {**a_then_b, "required": ["a", "b"]}]}
    assert accepted(grammars, branches, {"a": 1, "b": 2}) == '{"a": 1, "b": 2}'
    assert accepted(grammars, branches, {"b": 2}) == '{"b": 2}'


def test_a_case_counts_as_refused_not_applicable_or_run(grammars):
    boolean = {"description": "true", "schema": True, "tests": [{"description": "any", "data": 1, "valid": True}]}
    remote = {
        "description": "remote",
        "schema": {"$ref": "http://localhost:1234/draft2020-12/integer.json"},
        "tests": [
            {"description": "int", "data": 1, "valid": True},
            {"description": "str", "data": "a", "valid": False},
        ],
    }
    empty_enum = {
        "description": "empty",
        "schema": {"enum": []},
        "tests": [{"description": "x", "data": 1, "valid": False}],
    }
    unique = {
        "description": "unique",
        "schema": {"type": "array", "uniqueItems": True},
        "tests": [
            {"description": "unique", "data": [1, 2], "valid": True},
            {"description": "repeated", "data": [1, 1], "valid": False},
        ],
    }
    tally = suite.Tally("mixed")
    for case in (boolean, remote, empty_enum, unique):
        suite.run_case(case, grammars, tally)
    assert (tally.cases, tally.tests, tally.not_applicable, tally.refused) == (4, 6, 3, 1)
    assert (tally.grammar_passed, tally.checked_passed) == (1, 2)  # the check catches what the grammar leaves out
    assert tally.row() == ["mixed", 4, 6, 1, 3, "50.0%", "100.0%"]
    assert (
        tally.failure == "unique / repeated: `[1, 1]`: accepted though invalid (left out of the grammar: uniqueItems)"
    )


def test_a_valid_instance_the_grammar_rejects_fails_both_rates_saying_where(grammars):
    case = {
        "description": "closed",
        "schema": B_THEN_A,
        "tests": [{"description": "other", "data": {"c": 1}, "valid": True}],
    }
    tally = suite.Tally("properties")
    suite.run_case(case, grammars, tally)
    assert (tally.grammar_passed, tally.checked_passed) == (0, 0)
    assert tally.failure.startswith('closed / other: `{"c": 1}`: rejected though valid (Parser Error: ')


def test_the_report_totals_and_lists_the_lowest_rates():
    high = suite.Tally("high", cases=1, tests=4, grammar_passed=4, checked_passed=4)
    low = suite.Tally("low", cases=2, tests=5, refused=1, grammar_passed=1, checked_passed=3, failure="why")
    none = suite.Tally("none", cases=1, tests=2, not_applicable=2)
    text = suite.report([high, low, none], [], suite.Path("engine"), 1.25)
    assert "| total | 4 | 11 | 1 | 2 | 62.5% | 87.5% |" in text
    assert "| none | 1 | 2 | 0 | 2 | n/a | n/a |" in text
    assert "* low (25.0%): why" in text and "optional/format" not in text
    assert text.endswith("Elapsed: 1.2 s\n")


def test_the_docstring_names_the_pinned_suite_commit():
    assert suite.SUITE_COMMIT in suite.__doc__
