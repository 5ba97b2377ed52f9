"""The peer machinery of `make bench` that runs without the peers built: the manifest, the workers' environment,
what a failed build step reports, and the refusals of `bench peers`. The peers themselves (a 10-minute llama.cpp
compile, GB-sized environments) are exercised by `make bench`, not by the suite."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from pipeline.bench.peers import EngineSpec, PeerManifest
from pipeline.bench.peers.build import build_peers, failure, runs_natively
from pipeline.errors import PipelineError


def test_manifest_round_trips_and_names_what_was_not_built(tmp_path):
    spec = EngineSpec(
        "llama.cpp Q8_0",
        "llama.cpp",
        "Q8_0",
        "/py",
        "pipeline.bench.peers.llamacpp",
        "/m.gguf",
        {"LLAMA_CPP_LIB_PATH": "/lib"},
    )
    PeerManifest([spec], {"llama-server": "/bin/llama-server"}, {"openvino": "export failed"}).write(tmp_path)
    manifest = PeerManifest.read(tmp_path)
    assert manifest.engine("llama.cpp Q8_0") == spec and manifest.tools["llama-server"] == "/bin/llama-server"
    assert manifest.unavailable == {"openvino": "export failed"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"x" * 1000)
    (tmp_path / "model" / "config.json").write_text("{}")
    assert replace(spec, model=str(tmp_path / "model")).model_bytes == 1002  # a model directory: all its files
    missing = PeerManifest.read(tmp_path / "elsewhere")
    assert not missing.engines and "bench peers" in missing.unavailable["all peers"]


def test_workers_get_their_engine_environment_and_their_library_threading_defaults(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the Makefile's, for the test suite
    spec = EngineSpec(
        "x",
        "llama.cpp",
        "Q8_0",
        sys.executable,
        "pipeline.bench.peers.llamacpp",
        "/m.gguf",
        {"LLAMA_CPP_LIB_PATH": "/lib"},
        {"spinning": "on"},
    )
    env = spec.environment()
    assert "OMP_WAIT_POLICY" not in env and env["LLAMA_CPP_LIB_PATH"] == "/lib"
    assert env["PYTHONPATH"] and (__import__("pathlib").Path(env["PYTHONPATH"]) / "pipeline").is_dir()
    assert spec.command(2)[-4:] == ["/m.gguf", "--threads", "2", "--option=spinning=on"]


def test_a_failed_step_reports_its_error_line_not_its_last_lines():
    output = [
        "compiling",
        "Traceback (most recent call last):",
        "  File x",
        "nncf.errors.InvalidGroupSizeError: no",
        "Ensure that the group size divides",
        "Failed nodes:",
        '"layer.0" (channel size: 576)',
        '"layer.1"',
    ]
    assert failure(output).startswith("nncf.errors.InvalidGroupSizeError: no | Ensure")
    assert failure(["a", "b"]) == "a | b"


@pytest.mark.parametrize(("exit", "runs"), [("kill -SEGV $$", False), ("kill -ILL $$", False), ("exit 1", True)])
def test_llama_cpp_is_compiled_again_only_where_its_tools_die_by_a_signal(tmp_path, exit, runs):
    """A probe that dies by a signal (ggml's AMX kernels faulting) calls for the compile without AMX; an error
    exit is the tool's own answer, reported when it is used."""
    tool = tmp_path / "llama-bench"
    tool.write_text(f"#!/bin/sh\n{exit}\n")
    tool.chmod(0o755)
    assert runs_natively(tmp_path, tmp_path / "model.gguf") is runs


def test_bench_peers_needs_a_build_and_known_peer_names(tmp_path):
    with pytest.raises(PipelineError, match="no imported checkpoint"):
        build_peers(tmp_path, tmp_path / "cache")


def test_llama_cpp_tools_timings_become_the_rows_every_engine_gets(tmp_path):
    """llama-bench's tokens/s and llama-batched-bench's seconds, as (time to first token, total) of one run: a stand-in
    prints each tool's JSON line (the real tools run in `make bench`, once `bench peers` compiled them)."""
    from pipeline.bench.offline import decode_pairs, point
    from pipeline.bench.peers.native import NativeTimer, NativeToolError

    tools = {}
    for name, line in {
        "llama-bench": '{"n_prompt": 0, "avg_ts": 200.0}',
        "llama-batched-bench": '{"pl": 4, "t_pp": 0.5, "t_tg": 2.0}',
    }.items():
        tools[name] = tmp_path / name
        tools[name].write_text(f"#!/bin/sh\necho \"$*\" >&2\necho 'log line'\necho '{line}'\n")
        tools[name].chmod(0o755)
    spec = EngineSpec("llama.cpp Q8_0", "llama.cpp", "Q8_0", "python", "pipeline.bench.peers.llamacpp", "m.gguf")
    timer = NativeTimer(spec, {k: str(v) for k, v in tools.items()}, 2, tmp_path / "logs")
    ttft, total = timer.generate([[1] * 100], 65)
    assert (ttft, total) == (0.5, 0.5 + 64 / 200)  # 100 prompt tokens at 200 tok/s, then 64 decode steps
    assert "-p 0 -n 65 -d 100 -r 5 -o jsonl" in timer.log_path.read_text()
    row = point(timer, [(ttft, total)], 1, 100, 65)
    assert row["engine"] == "llama.cpp Q8_0 (its tools)" and row["decode_tok_s_per_seq"] == 200.0
    ttft, total = timer.generate([[1] * 10] * 4, 8)
    batched = point(timer, [(ttft, total)], 4, 10, 8)
    assert ttft == 0.5 and batched["decode_tok_s_total"] == 4 * 8 / 2.0  # the tool's tokens over its decode time
    ours = {**row, "engine": "ours", "kind": "ours", "raw_s": [[0.1, 0.1 + 64 / 220], [0.1, 0.1 + 64 / 180]]}
    peer = {**row, "raw_s": [[0.5, 0.5 + 64 / 200], [0.5, 0.5 + 64 / 200]]}
    (pairs,) = decode_pairs([ours, peer])
    assert pairs["pairs"] == [1.1, 0.9] and pairs["median"] == 1.0 and pairs["min"] == 0.9

    with pytest.raises(NativeToolError, match="llama-batched-bench not built"):
        NativeTimer(spec, {"llama-bench": str(tools["llama-bench"])}, 2, tmp_path)
