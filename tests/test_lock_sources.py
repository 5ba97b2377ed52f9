"""The lock sees all the code: editing a module a stage executes, or a file it copies, re-runs exactly
that stage (and what depends on its output), and `plan` names the file."""

from __future__ import annotations

import json
import shutil

from pipeline.lock_sources import source_files
from tests.conftest import REPO, slow_fixture, spawn_cli, write_config


@slow_fixture(scope="module")
def built_tree(tmp_path_factory, tiny_llama):
    """A private copy of the package (edited by the tests) and a full tiny CPU build made by that copy."""
    root = tmp_path_factory.mktemp("sources")
    shutil.copytree(REPO / "pipeline", root / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    config = write_config(
        root / "tiny.yaml",
        f"""
        model: {{source: hf, path: {tiny_llama}}}
        build: {{max_batch_size: 2, max_input_len: 64, max_seq_len: 128, max_num_tokens: 64}}
        verify: {{eval_tokens: 128}}
    """,
    )
    result = spawn_cli(
        "build", str(config), "--output", str(root / "out"), cwd=root
    )  # cwd first on sys.path: the copy runs
    assert result.returncode == 0, result.stdout + result.stderr
    return root, config


def plan_after_editing(built_tree, relative: str) -> dict[str, dict]:
    root, config = built_tree
    path = root / relative
    original = path.read_bytes()
    path.write_bytes(original + (b"\n# edited\n" if path.suffix == ".py" else b"\n"))
    try:
        result = spawn_cli("plan", str(config), "--output", str(root / "out"), "--json", cwd=root)
    finally:
        path.write_bytes(original)
    assert result.returncode == 0, result.stdout + result.stderr
    return {row["stage"]: row for row in json.loads(result.stdout)}


def test_editing_the_fused_graph_builder_reruns_export_and_says_why(built_tree):
    rows = plan_after_editing(built_tree, "pipeline/targets/onnxruntime/graph.py")
    assert rows["import"]["status"] == "up to date"
    assert rows["export"]["status"] == "will run"
    assert "code changed: pipeline/targets/onnxruntime/graph.py" in rows["export"]["reasons"]
    assert rows["triton_repo"]["status"] == "will run"  # downstream of a re-run export


def test_editing_a_copied_triton_model_reruns_only_the_repository(built_tree):
    rows = plan_after_editing(built_tree, "pipeline/triton/models/postprocessing.py")
    assert {stage: row["status"] for stage, row in rows.items() if row["status"] == "will run"} == {
        "triton_repo": "will run"
    }
    assert rows["triton_repo"]["reasons"] == ["code changed: pipeline/triton/models/postprocessing.py"]


def test_editing_the_runtime_the_triton_model_imports_reruns_the_repository(built_tree):
    rows = plan_after_editing(built_tree, "pipeline/targets/onnxruntime/runtime/scheduler.py")
    assert rows["triton_repo"]["status"] == "will run"
    assert "code changed: pipeline/targets/onnxruntime/runtime/scheduler.py" in rows["triton_repo"]["reasons"]
    assert rows["import"]["status"] == "up to date"


def test_editing_another_target_reruns_nothing(built_tree):
    rows = plan_after_editing(built_tree, "pipeline/targets/trtllm/adapter.py")
    assert {row["status"] for row in rows.values()} <= {"up to date", "skipped"}


def test_an_unchanged_tree_is_up_to_date(built_tree):
    root, config = built_tree
    result = spawn_cli("build", str(config), "--output", str(root / "out"), cwd=root)
    assert result.returncode == 0 and "nothing to do" in result.stdout, result.stdout + result.stderr


def test_target_sources_exist_and_registries_are_not_followed():
    from pipeline.targets import TARGETS

    for target in TARGETS.values():
        for stage, roots in target.sources.items():
            files = source_files(roots)
            assert len(files) >= len(roots), (target.name, stage)
            adapters = {f.parent.name for f in files if f.name == "adapter.py"}  # the shared Triton checks read
            assert adapters <= {target.name}, (target.name, stage, adapters)  # facts of others, not their adapters


def _json_names(path) -> set[str]:
    """The literal "xxx.json" names in a module that builds paths from its own location (`Path(__file__)`)."""
    import ast

    text = path.read_text()
    if "Path(__file__)" not in text:
        return set()
    return {
        node.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".json")
    }


def test_every_table_a_hashed_module_loads_is_hashed():
    """A stage's lock covers the JSON tables its modules load next to themselves (`Path(__file__)...`): a table
    missing from the target's `sources` would let an edit to it leave that stage "up to date"."""
    from pipeline.lock_sources import PACKAGE_ROOT
    from pipeline.stages import STAGES
    from pipeline.targets import TARGETS

    package_tables = {}
    for table in (PACKAGE_ROOT / "pipeline").rglob("*.json"):
        package_tables.setdefault(table.name, []).append(table.resolve())
    missing = []
    for target in TARGETS.values():
        for stage in STAGES.values():
            roots = (stage.__name__, *stage.SOURCES, *target.sources.get(stage.NAME, ()))
            files = set(source_files(roots))
            for module in (f for f in files if f.suffix == ".py"):
                for name in _json_names(module):
                    tables = package_tables.get(name, [])  # "config.json" and the like name no package file
                    if tables and not files.intersection(tables):
                        missing.append((target.name, stage.NAME, module.name, name))
    assert not missing, missing
    export = {f.name for f in source_files(("pipeline.stages.export", *TARGETS["trtllm"].sources["export"]))}
    assert {"trtllm_engine_models.json", "trtllm_checkpoint.json"} <= export


def test_type_only_imports_are_not_followed_but_their_else_and_function_imports_are(tmp_path):
    from pipeline.lock_sources import imported_modules

    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pipeline import quality\nelse:\n    from pipeline import errors\n"
        "def later():\n    from pipeline.targets.onnxruntime import graph\n"
    )
    everything = imported_modules(module)
    assert {"pipeline.errors", "pipeline.targets.onnxruntime.graph"} <= everything
    assert {"pipeline.targets", "pipeline.targets.onnxruntime"} <= everything  # the packages an import runs first
    assert "pipeline.quality" not in everything
    assert imported_modules(module, module_level=True) == {"pipeline", "pipeline.errors"}  # a facade's
