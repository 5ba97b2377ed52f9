"""The upstream fact tables (pipeline/upstream/): facts in our own form, cited by commit, stored once, and no
upstream text anywhere in the repository's package or tests."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pipeline.lock_sources import source_files
from pipeline.upstream import TABLES, NotTabulated, compact, facts, release_facts, releases, resolved_releases
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "dev"))
from upstream_source import cite, stored_releases  # noqa: E402

TABLE_NAMES = sorted(path.stem for path in TABLES.glob("*.json"))
# What an upstream file's header says (written so that this file says none of it).
LICENCE_HEADER = re.compile(
    r"c[o]pyright\s*(\(c\)|©|\d{4})|l[i]censed under the|spdx-l[i]cense-identifier|nvidia c[o]rporation", re.I
)
# Fields that held upstream text or citations nobody else can follow: the tables keep facts, not sources' words.
TEXT_FIELDS = {"comment", "excerpt", "expr", "ranges", "total_chars", "line_in_slice", "slice_offset"}
# What a source record may say: anything else (an identifier that only one machine resolves) cannot be followed.
CITATION_KEYS = {"repo", "path", "commit", "pinned", "release_commit", "read_for", "template_names_described_by"}
BARE_NUMBER_ID = re.compile(r"\b\d{9,}\b")  # a long number standing for a source, where a commit belongs
SIZE_BUDGET = 400_000  # bytes of all tables together (1.15 MB pretty-printed with repeated releases before)


def licence_headers(paths) -> list[str]:
    """The files among `paths` whose first 40 lines carry a licence header."""
    found = []
    for path in paths:
        try:
            head = "".join(path.read_text(errors="replace").splitlines(keepends=True)[:40])
        except (IsADirectoryError, FileNotFoundError):
            continue
        if LICENCE_HEADER.search(head):
            found.append(str(path.relative_to(REPO)))
    return found


def test_no_committed_file_in_the_package_or_the_tests_carries_a_licence_header():
    listed = subprocess.run(
        ["git", "ls-files", "pipeline", "tests", "scripts"], cwd=REPO, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    assert licence_headers(REPO / name for name in listed.stdout.split()) == []


def test_the_licence_check_finds_a_header_in_the_first_lines(tmp_path):
    header = (
        "# SPDX-FileC" + "opyrightText: C" + "opyright (c) 2024 Someone\n# SPDX-L" + "icense-Identifier: Apache-2.0\n"
    )
    (tmp_path / "tests").mkdir()
    carried, clean = tmp_path / "tests" / "carried.py", tmp_path / "tests" / "clean.py"
    carried.write_text(header + "x = 1\n")
    clean.write_text("x = 1  # our own file\n")
    found = [path for path in (carried, clean) if LICENCE_HEADER.search(path.read_text())]
    assert found == [carried]


def walk(node, path=()):
    """(path, key, value) of every mapping entry in a JSON value."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from walk(value, (*path, key))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from walk(item, (*path, index))


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_each_table_is_stored_compact_and_holds_facts_not_upstream_text(name):
    path = TABLES / f"{name}.json"
    stored = json.loads(path.read_text())
    assert path.read_text() == compact(stored), f"{path} is not as pipeline.upstream.compact writes it"
    text_fields = [(p, key) for p, key, _ in walk(stored) if key in TEXT_FIELDS]
    assert text_fields == [], f"{name}: fields that held upstream text"
    numbers = [
        (p, key, value) for p, key, value in walk(stored) if isinstance(value, str) and BARE_NUMBER_ID.search(value)
    ]
    assert numbers == [], f"{name}: sources named by a number instead of a commit"


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_every_source_is_cited_by_repository_path_and_commit(name):
    sources = [value for _, key, value in walk(json.loads((TABLES / f"{name}.json").read_text())) if key == "commit"]
    assert sources, f"{name} cites no commit"
    for _, _, record in walk(json.loads((TABLES / f"{name}.json").read_text())):
        if isinstance(record, dict) and "commit" in record and "repo" in record:
            assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record
            assert set(record) <= CITATION_KEYS, f"{name}: {record} cites by more than repository, path and commit"
            assert record.get("pinned") in (True, False), f"{name}: {record} says not whether it is pinned"
            assert not (record["pinned"] and record["commit"] is None), record


def test_all_tables_together_stay_within_the_size_budget():
    sizes = {path.name: path.stat().st_size for path in TABLES.glob("*.json")}
    assert sum(sizes.values()) <= SIZE_BUDGET, sizes


def test_releases_shared_by_blocks_come_back_whole_and_in_order():
    fields = {f"field_{n}": {"type": "int", "default": n} for n in range(20)}
    base = {"fields": {**fields, "b": {"c": [1, 2]}}, "source": cite("o/r", "f.py", "1" * 40)}
    same = json.loads(json.dumps(base))
    changed = json.loads(json.dumps(base))
    changed["fields"]["b"]["c"].append(3)
    changed["source"]["commit"] = "2" * 40
    reordered = {"source": changed["source"], "fields": base["fields"]}  # jsonpatch's own diff loses this key order
    table = {"0.1": base, "0.2": same, "0.3": changed, "0.4": reordered}
    stored = stored_releases(table)
    assert stored["0.2"] == {"same_as": "0.1"}
    assert stored["0.3"]["based_on"] == "0.2" and len(stored["0.3"]["patch"]) == 2
    assert stored["0.4"]["based_on"] == "0.3"
    back = resolved_releases(stored)
    assert json.dumps(back) == json.dumps(table)


def test_a_release_not_tabulated_is_refused_naming_the_table_and_what_it_has():
    with pytest.raises(NotTabulated) as refused:
        release_facts("llm_args", "0.9", "The LLM-API options")
    message = str(refused.value)
    assert "The LLM-API options is not tabulated for TensorRT-LLM 0.9" in message
    assert ", ".join(releases("llm_args")) in message and "scripts/dev/tabulate_all.py --only llm_args" in message


def test_a_citation_refuses_what_is_not_a_commit():
    assert cite("NVIDIA/TensorRT-LLM", "a.py", None) == {
        "repo": "NVIDIA/TensorRT-LLM",
        "path": "a.py",
        "commit": None,
        "pinned": False,
    }
    with pytest.raises(ValueError, match="not a 40-hex commit"):
        cite("NVIDIA/TensorRT-LLM", "a.py", "v1.2.0")


def test_the_build_lock_hashes_the_tables_a_module_reads_by_name():
    files = {path.name for path in source_files(("pipeline.targets.trtllm.llm_api_options",))}
    assert {"__init__.py", "llm_args.json"} <= files
    assert "leaderworkerset.json" not in files  # only what the module reads


def test_every_table_loads_and_every_release_resolves():
    for name in TABLE_NAMES:
        table = facts(name)
        for release, block in table.get("releases", {}).items():
            assert isinstance(block, dict) and not {"same_as", "based_on"} & set(block), (name, release)
