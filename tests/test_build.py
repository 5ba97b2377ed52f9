"""The stage pipeline and its manifest: skip when unchanged, re-run exactly the readers of a change,
and never trust a half-written stage."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipeline import stages
from pipeline.build import build
from pipeline.lock import read_lock
from pipeline.plan import SKIPPED, UP_TO_DATE, WILL_RUN, plan
from pipeline.targets import TARGETS
from pipeline.validation import load_config
from tests.conftest import REPO, run_cli, write_config


def tiny_config(tmp_path: Path, tiny_llama: Path, extra: str = "") -> Path:
    return write_config(tmp_path / "tiny.yaml", f"model:\n  source: hf\n  path: {tiny_llama}\n{extra}")


def statuses(cfg, output):
    return {d.stage: d.status for d in plan(cfg, output, read_lock(output))}


@pytest.fixture
def every_stage_runs(monkeypatch):
    """Stand-in bodies for the stages that cannot run on this machine (the trtllm engine needs a GPU and
    trtllm-build) and for every stage after them, which would read the missing output; so the planner is
    tested over the full chain. READS, applicability, upstream wiring and the stages that can run stay real."""
    if TARGETS["trtllm"].unavailable() is None:
        return
    for module in (stages.engine, stages.triton_repo):

        def run(cfg, ctx, module=module, real=module.run):
            if cfg.target.name != "trtllm":
                return real(cfg, ctx)
            (ctx.out_dir / "params.json").write_text(
                json.dumps({p: str(getattr(cfg, p.split(".")[0])) for p in module.READS})
            )
            return {}

        monkeypatch.setattr(module, "run", run)


def test_unchanged_rebuild_does_nothing_and_changes_rerun_only_their_readers(tmp_path, tiny_llama, every_stage_runs):
    console = Console(file=open(os.devnull, "w"))
    output = tmp_path / "out"
    cfg = load_config(tiny_config(tmp_path, tiny_llama))
    build(cfg, output, console)
    assert set(statuses(cfg, output).values()) <= {UP_TO_DATE, SKIPPED}
    first = read_lock(output)

    runtime_knob = load_config(tiny_config(tmp_path, tiny_llama, "runtime:\n  max_queue_delay_microseconds: 500\n"))
    assert {s for s, v in statuses(runtime_knob, output).items() if v == WILL_RUN} == {"triton_repo"}

    quantized = load_config(tiny_config(tmp_path, tiny_llama, "quantization:\n  weights: int8\n"))
    assert {s for s, v in statuses(quantized, output).items() if v == WILL_RUN} == {"engine", "triton_repo"}
    build(quantized, output, console)
    second = read_lock(output)
    assert second["stages"]["import"] == first["stages"]["import"]
    assert second["stages"]["engine"]["input_hash"] != first["stages"]["engine"]["input_hash"]


def test_quantization_change_reruns_from_quantize_on_trtllm(tmp_path, tiny_llama, every_stage_runs):
    output = tmp_path / "out"
    cfg = load_config(tiny_config(tmp_path, tiny_llama, "target:\n  name: trtllm\nquantization:\n  weights: fp8\n"))
    build(cfg, output, Console(file=open(os.devnull, "w")))
    changed = load_config(
        tiny_config(tmp_path, tiny_llama, "target:\n  name: trtllm\nquantization:\n  weights: int4\n  group_size: 32\n")
    )
    assert [s for s, v in statuses(changed, output).items() if v == WILL_RUN] == [
        "quantize",
        "export",
        "engine",
        "triton_repo",
    ]


def test_import_output_is_trusted_only_while_unmodified(tmp_path, tiny_llama, cli_build):
    output = tmp_path / "out"
    config = tiny_config(tmp_path, tiny_llama)
    assert cli_build(str(config), "--output", str(output), "--until", "import").returncode == 0
    cfg = load_config(config)
    assert statuses(cfg, output)["import"] == UP_TO_DATE
    (output / "import" / "tokenizer.json").write_text("{}")
    decision = plan(cfg, output, read_lock(output))[0]
    assert decision.status == WILL_RUN and "modified" in decision.reasons[0]


def test_killed_stage_leaves_nothing_trusted(tmp_path, tiny_llama, cli_build):
    output = tmp_path / "out"
    config = tiny_config(tmp_path, tiny_llama)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "build", str(config), "--output", str(output)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not list(output.glob(".tmp-import-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(output.glob(".tmp-import-*")), "the import stage never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (output / "import").exists()
    cfg = load_config(config)
    assert statuses(cfg, output)["import"] == WILL_RUN

    # what a kill between mkstemp and rename in write_json_atomic leaves (the window is too short to hit reliably)
    (output / ".build.lock.json.k1ll3d").write_text('{"format": 1')
    result = cli_build(str(config), "--output", str(output), "--until", "import")
    assert result.returncode == 0, result.stderr
    assert not list(output.glob(".tmp-*")), "leftovers of the killed run were not cleaned"
    assert not list(output.glob(".build.lock.json.*")), "a killed lock write's temp file was not cleaned"
    assert statuses(cfg, output)["import"] == UP_TO_DATE


def test_second_build_on_same_output_is_refused(tmp_path, tiny_llama, cli_build):
    output = tmp_path / "out"
    output.mkdir()
    with open(output / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = cli_build(str(tiny_config(tmp_path, tiny_llama)), "--output", str(output))
    assert result.returncode == 1
    assert "another build is running" in result.stderr


def test_until_rejects_unknown_stage(tmp_path, tiny_llama):
    result = run_cli("build", str(tiny_config(tmp_path, tiny_llama)), "--until", "engin")
    assert result.returncode == 1 and "unknown stage" in result.stderr


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write to: mode 0555, and immutable when the tests run as root (who ignores modes)."""
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root and chattr +i is not permitted here: no directory is read-only to root")
    yield path
    if immutable:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


@pytest.mark.parametrize("inside", [False, True], ids=["is-read-only", "under-read-only"])
def test_a_read_only_output_directory_is_named_with_the_fix(tmp_path, tiny_llama, read_only_dir, inside, cli_build):
    output = read_only_dir / "out" if inside else read_only_dir
    result = cli_build(str(tiny_config(tmp_path, tiny_llama)), "--output", str(output))
    assert result.returncode == 1, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert (
        f"cannot write to the output directory {output}: " in message
        and "choose a writable one with --output" in message
    )
    assert "Traceback" not in result.stderr
