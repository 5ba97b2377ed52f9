"""The engine the scheduler tests share (test_scheduler, test_kv_cache): built once per session, it is their
slowest part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from tests.conftest import run_cli, slow_fixture, write_config


def finish_engine_dir(hf_dir: Path, engine: Path, max_batch_size: int) -> Path:
    """Make a directory holding a graph (model.onnx) an engine: the onnxruntime target's config.json for a small
    build and the checkpoint's tokenizer files, without the CLI build the tests that need one graph can skip."""
    from pipeline.targets.onnxruntime.adapter import engine_config
    from pipeline.validation import load_config

    cfg = load_config(
        write_config(
            engine.parent / f"{engine.name}.yaml",
            f"model: {{source: hf, path: {hf_dir}}}\n"
            f"build: {{max_batch_size: {max_batch_size}, max_input_len: 64, max_seq_len: 160, max_num_tokens: 256}}\n",
        )
    )
    hf_config = json.loads((hf_dir / "config.json").read_text())
    (engine / "config.json").write_text(json.dumps(engine_config(cfg, hf_config, {"eos_token_id": 2})))
    for tokenizer_file in hf_dir.glob("*token*"):
        shutil.copy(tokenizer_file, engine)
    return engine


MAX_BATCH_SIZE, MAX_INPUT_LEN, MAX_SEQ_LEN, MAX_NUM_TOKENS = 8, 64, 128, 16


@slow_fixture(scope="session")
def runner(tmp_path_factory, tiny_llama) -> ModelRunner:
    """The fused graph (SharedCache), fp32, with a small max_num_tokens, so long prompts are prefilled in pieces
    (test_model_runner overrides it with its own engines)."""
    work = tmp_path_factory.mktemp("scheduler-engine")
    config = write_config(
        work / "tiny.yaml",
        f"""
        model:
          source: hf
          path: {tiny_llama}
        target:
          onnx_graph: fused
        build:
          max_batch_size: {MAX_BATCH_SIZE}
          max_input_len: {MAX_INPUT_LEN}
          max_seq_len: {MAX_SEQ_LEN}
          max_num_tokens: {MAX_NUM_TOKENS}
        runtime:
          enable_chunked_context: true
        """,
    )
    result = run_cli("build", str(config), "--output", str(work / "out"), "--until", "engine")
    assert result.returncode == 0, result.stdout + result.stderr
    return ModelRunner.from_dir(work / "out" / "engine", num_threads=1)
