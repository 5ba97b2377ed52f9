"""`bench structured`'s pieces that need no server: the seeded draw of schemas per set, where the data comes from,
the benchmark's own judgement of an answer, and the counts and table made from hand-written rows."""

from __future__ import annotations

import json
import tarfile

import pytest

from pipeline.bench import structured
from pipeline.bench.structured import (
    DATA_HINT,
    Drawn,
    chat_request,
    draw,
    judge,
    notes,
    sets_folder,
    summaries,
    table,
)
from pipeline.errors import PipelineError

OBJECT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def make_sets(root, files_per_set: dict[str, int]):
    """data/SET/s<i>.json under `root`, each a tiny object schema naming its file."""
    for name, count in files_per_set.items():
        (root / "data" / name).mkdir(parents=True)
        for index in range(count):
            schema = {"title": f"{name}/{index}", **OBJECT}
            (root / "data" / name / f"s{index}.json").write_text(json.dumps(schema))
    return root / "data"


def test_the_draw_is_seeded_per_set_whatever_other_sets_are_chosen(tmp_path):
    root = make_sets(tmp_path, {"A": 12, "B": 9, "Tiny": 2})
    both = draw(root, ["A", "B"], 3, seed=0)
    assert [d.file for d in both if d.set == "A"] == [d.file for d in draw(root, ["A"], 3, seed=0)]
    assert [d.file for d in both if d.set == "B"] == [d.file for d in draw(root, ["B", "A"], 3, seed=0) if d.set == "B"]
    assert both == draw(root, ["A", "B"], 3, seed=0)
    # random.Random(0).sample of the sorted names: s0, s1, s10, s11, s2, ... for A
    assert [d.file for d in both] == ["s4.json", "s9.json", "s0.json", "s6.json", "s8.json", "s0.json"]
    assert [d.file for d in draw(root, ["A"], 3, seed=1)] != [d.file for d in both if d.set == "A"]
    assert {d.file for d in draw(root, ["Tiny"], 50, seed=0)} == {"s0.json", "s1.json"}  # a smaller set: all of it
    assert all(d.schema["title"] == f"{d.set}/{d.file[1:-5]}" for d in both)


def test_a_drawn_file_that_is_not_a_schema_is_kept_with_the_reason(tmp_path):
    root = make_sets(tmp_path, {"A": 1})
    (root / "A" / "broken.json").write_text("{not json")
    (root / "A" / "list.json").write_text("[1, 2]")
    drawn = {d.file: d for d in draw(root, ["A"], 3, seed=0)}
    assert drawn["s0.json"].schema is not None and drawn["s0.json"].not_a_schema is None
    assert drawn["broken.json"].schema is None and drawn["broken.json"].not_a_schema.startswith("not JSON:")
    assert drawn["list.json"].not_a_schema == "not an object but a JSON list"


def test_data_is_a_checkout_or_its_data_folder_and_a_bad_one_is_named_with_the_fix(tmp_path):
    root = make_sets(tmp_path / "checkout", {"A": 1})
    assert sets_folder(tmp_path / "checkout", tmp_path / "cache", print) == root
    assert sets_folder(root, tmp_path / "cache", print) == root
    empty = tmp_path / "empty"
    empty.mkdir()
    said = {
        empty: "holds no sets (folders of *.json schemas, e.g. Github_easy/)",
        tmp_path / "absent": "does not exist",
    }
    for where, says in said.items():
        with pytest.raises(PipelineError) as error:
            draw(sets_folder(where, tmp_path / "cache", print), ["A"], 1, 0)
        assert str(error.value) == f"{where} {says}: {DATA_HINT}"
    assert "ba103c73756198dd9b149ddc7db7867da7a077f6" in DATA_HINT
    with pytest.raises(PipelineError, match=r"--set Nope: no such set in .*data; its sets: A$"):
        draw(root, ["A", "Nope"], 1, 0)


def test_without_data_only_the_tarballs_data_folder_is_kept_in_the_cache(tmp_path, monkeypatch):
    top = tmp_path / f"jsonschemabench-{structured.JSONSCHEMABENCH_COMMIT}"
    make_sets(top, {"A": 2})
    (top / "README.md").write_text("not data")
    tarball = tmp_path / "github.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(top, arcname=top.name)
    monkeypatch.setattr(structured, "JSONSCHEMABENCH_URL", tarball.as_uri())
    logged = []
    root = sets_folder(None, tmp_path / "cache", logged.append)
    assert root == tmp_path / "cache" / top.name / "data"
    assert sorted(p.name for p in root.parent.iterdir()) == ["data"] and len(list((root / "A").iterdir())) == 2
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [top.name]  # the temporary folder is gone
    assert logged[0].startswith("downloading JSONSchemaBench ba103c73756")
    tarball.unlink()
    assert sets_folder(None, tmp_path / "cache", logged.append) == root  # once


def test_the_request_asks_for_the_schema_without_strict():
    body = chat_request("m", OBJECT, 384)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "schema", "schema": OBJECT}}
    assert body["temperature"] == 0 and body["max_tokens"] == 384 and "stream" not in body


def test_strict_and_the_compact_layout_are_asked_as_openai_and_llguidance_spell_them():
    """--strict is OpenAI's `strict: true` beside the schema; --whitespace compact is llguidance's own extension in the
    schema (`x-guidance`), which llama-server ignores; neither touches the schema drawn."""
    body = chat_request("m", OBJECT, 384, layout=structured.WHITESPACE["compact"], strict=True)
    asked = body["response_format"]["json_schema"]
    assert asked["strict"] is True and asked["schema"]["x-guidance"]["whitespace_flexible"] is False
    assert {k: v for k, v in asked["schema"].items() if k != "x-guidance"} == OBJECT and "x-guidance" not in OBJECT
    assert chat_request("m", OBJECT, 384, layout=structured.WHITESPACE["engine"]) == chat_request("m", OBJECT, 384)


def test_answers_are_judged_by_jsonschema_in_the_schemas_own_draft_with_formats():
    assert judge(OBJECT, '{"n": 3}') == (True, None)
    assert judge(OBJECT, '{"n": "3"}') == (False, "$.n: '3' is not of type 'integer'")
    assert judge(OBJECT, '{"n": 3')[1].startswith("not JSON:")
    assert judge({"type": "string", "format": "ipv4"}, '"1.2.3"')[0] is False  # formats are asserted
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number",
        "maximum": 3,
        "exclusiveMaximum": True,
    }
    assert judge(draft4, "3")[0] is False  # draft 4's boolean exclusiveMaximum
    unusable = judge({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}, '{"a": 1}')
    assert unusable[0] is None and "PointerToNowhere" in unusable[1]
    assert judge({"type": 12}, "1")[0] is None  # not a schema of its draft
    older = {"properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}}  # draft 7's keyword, no $schema
    assert judge(older, '{"a": 1}') == (False, "$: 'b' is a dependency of 'a'") and judge(older, "{}")[0] is True


def row(set_name: str, file: str, *, status=200, finish="stop", valid=True, seconds=1.0, reported=None) -> dict:
    answer = {"set": set_name, "file": file, "status": status, "seconds": seconds}
    if status != 200:
        return answer | {"error": "refused"}
    answer |= {"finish_reason": finish, "content": "{}", "schema_valid": valid, "why": None}
    return answer | ({"structured_output": {"valid": reported}} if reported is not None else {})


def test_the_summary_counts_hand_written_rows_per_set_and_in_total():
    drawn = [Drawn("A", f"a{i}.json", OBJECT) for i in range(5)] + [Drawn("A", "bad.json", None, "not JSON: x")]
    drawn += [Drawn("B", f"b{i}.json", OBJECT) for i in range(2)]
    ours = [
        row("A", "a0.json", reported=True),
        row("A", "a1.json", valid=False, reported=True),  # the gateway disagrees
        row("A", "a2.json", finish="length", valid=False, reported=False),
        row("A", "a3.json", valid=None, seconds=3.0),  # unjudgeable
        row("A", "a4.json", status=400),
        row("B", "b0.json"),
        row("B", "b1.json"),
    ]
    peer = [row("A", f"a{i}.json", valid=i < 1) for i in range(5)] + [
        row("B", "b0.json"),
        row("B", "b1.json", valid=False),
    ]
    compiles = [{"set": "A", "file": "a0.json", "compile_ms": 10.0}, {"set": "A", "file": "a1.json", "refused": "no"}]
    summary = summaries(drawn, {"ours": ours, "llama-server": peer}, compiles)
    a = summary["A"]
    assert (a["sampled"], a["not_a_schema"]) == (6, 1)
    assert {
        k: a["servers"]["ours"][k] for k in ("requests", "accepted", "finished", "valid", "invalid", "unjudgeable")
    } == {
        "requests": 5,
        "accepted": 4,
        "finished": 3,
        "valid": 1,
        "invalid": 1,
        "unjudgeable": 1,
    }
    assert a["servers"]["ours"]["structured_output"] == {"reported": 3, "compared": 3, "disagree": 1}
    assert a["servers"]["ours"]["seconds_p50"] == 1.0 and a["servers"]["ours"]["seconds_p99"] == pytest.approx(2.94)
    assert a["compile"] == {"compiled": 1, "refused": 1, "failed": 0, "compile_ms_p50": 10.0, "compile_ms_p99": 10.0}
    assert a["valid_ratio"] == 1.0 and summary["B"]["valid_ratio"] == 2.0
    total = summary["total"]
    assert (
        total["sampled"] == 8
        and total["servers"]["ours"]["valid"] == 3
        and total["servers"]["llama-server"]["valid"] == 2
    )
    assert total["valid_ratio"] == 1.5 and "structured_output" not in total["servers"]["llama-server"]

    text = table(summary)
    assert "| A | ours | 6 | 1 | 4 | 3 | 1 | 1 | 1 | 10.00 | 10.00 | 1.00 | 2.94 | 1.00x |" in text
    assert "| total | llama-server | 8 | 1 | 7 | 7 | 2 | 5 | 0 | not measured | not measured |" in text
    results = {"not_a_schema": [{"set": "A", "file": "bad.json", "why": "not JSON: x"}], "summary": summary}
    results["servers"] = {
        "ours": {"died": "postprocessing died\nits log"},
        "llama-server": {"unavailable": "not built"},
    }
    lines = notes(results).splitlines()
    assert lines[0] == "- A/bad.json: not a schema (not JSON: x)"
    assert "- llama-server: not run: not built" in lines
    assert "- ours: the server died during the run: postprocessing died" in lines
    assert lines[-1].endswith("disagrees with the judgement here on 1 of 3 answers both judged")


def test_without_a_peer_the_ratio_reads_n_a():
    drawn = [Drawn("A", "a.json", OBJECT)]
    summary = summaries(drawn, {"ours": [row("A", "a.json")]}, [])
    assert summary["A"]["valid_ratio"] is None and "| n/a |" in table(summary)


def test_compile_times_are_of_the_guides_the_requests_ask_for_strict_or_not(smollm2_build):
    """The compile column times what the gateway compiles for the benchmark's own requests: under --strict a schema the
    grammar cannot wholly enforce is refused, as the gateway refuses it; without, it compiles relaxed."""
    unique = Drawn("A", "unique.json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    drawn = [unique, Drawn("A", "object.json", OBJECT)]
    compact = structured.WHITESPACE["compact"]
    strict = structured.compile_times(smollm2_build / "engine", drawn, lambda _: None, compact, strict=True)
    assert "uniqueItems" in strict[0]["refused"] and strict[1]["compile_ms"] > 0 and strict[1]["relaxed"] == []
    relaxed = structured.compile_times(smollm2_build / "engine", drawn, lambda _: None)
    assert relaxed[0]["relaxed"] == ["uniqueItems"] and relaxed[0]["compile_ms"] > 0
    laid_out = structured.compile_times(smollm2_build / "engine", drawn[1:], lambda _: None, {"lenient": True})
    assert "x-guidance" in laid_out[0]["refused"]  # the layout reaches the gateway's prepare, as the requests' does
