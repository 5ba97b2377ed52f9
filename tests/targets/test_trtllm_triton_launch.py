"""How a repository of Triton's C++ `tensorrtllm` backend is launched (`pipeline.targets.trtllm.triton_launch`):
one tritonserver per rank of the engine, as tensorrtllm_backend's launcher starts them
(triton-inference-server/tensorrtllm_backend scripts/launch_triton_server.py @ c1e19638304d287f554f738c1411746555ed348c,
v0.19.0: every rank `--disable-auto-complete-config` and its own `shm-region-prefix-name=prefix<rank>_`; ranks past 0
`--model-control-mode=explicit` loading only the engine's model; under `mpirun --allow-run-as-root`, `-n 1` per rank,
ranks separated by `:`)."""

from __future__ import annotations

import json

import pytest
from tritonclient.grpc import model_config_pb2

from pipeline.errors import TargetUnavailable
from pipeline.targets.trtllm.triton_launch import container_launch, tensorrtllm_world_size, tritonserver_ranks
from pipeline.triton.validate import RepoReport


def report_with_engine(tmp_path, mapping: dict | None) -> RepoReport:
    """A checked repository whose `tensorrt_llm` model serves an engine with `mapping` (None: no such model)."""
    report = RepoReport()
    report.models["preprocessing"] = model_config_pb2.ModelConfig(name="preprocessing", backend="python")
    if mapping is not None:
        engine = tmp_path / "engine"
        engine.mkdir()
        (engine / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": mapping}}))
        llm = model_config_pb2.ModelConfig(name="tensorrt_llm", backend="tensorrtllm")
        llm.parameters["gpt_model_path"].string_value = str(engine)
        report.models["tensorrt_llm"] = llm
    return report


def test_the_world_size_is_the_engines_mapping_or_tp_times_pp(tmp_path):
    assert tensorrtllm_world_size(report_with_engine(tmp_path / "a", None)) == (None, 0)
    (tmp_path / "b").mkdir()
    assert tensorrtllm_world_size(report_with_engine(tmp_path / "b", {"world_size": 4})) == ("tensorrt_llm", 4)
    (tmp_path / "c").mkdir()
    assert tensorrtllm_world_size(report_with_engine(tmp_path / "c", {"tp_size": 2, "pp_size": 3})) == (
        "tensorrt_llm",
        6,
    )


def test_rank_zero_serves_the_repository_and_the_others_only_the_engines_model():
    ranks = tritonserver_ranks("/models/repo", ["--http-port=8000"], 3, "tensorrt_llm")
    assert len(ranks) == 3
    for rank, args in enumerate(ranks):
        assert args[0] == "/opt/tritonserver/bin/tritonserver"
        assert "--model-repository=/models/repo" in args and "--http-port=8000" in args
        assert "--disable-auto-complete-config" in args
        assert f"--backend-config=python,shm-region-prefix-name=prefix{rank}_" in args
        explicit = ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
        assert (args[-2:] == explicit) == (rank > 0) and (explicit[0] in args) == (rank > 0)
    follower = tritonserver_ranks("/r", [], 2, "tensorrt_llm", followers=["--allow-http=false"])[1]
    assert follower[-1] == "--allow-http=false"


def test_outside_nvidias_container_the_launch_names_what_is_missing(tmp_path):
    assert container_launch(tmp_path, report_with_engine(tmp_path, None)) is None  # not a tensorrtllm repository
    launch = container_launch(tmp_path, report_with_engine(tmp_path, {"world_size": 2}))
    with pytest.raises(TargetUnavailable) as refused:
        launch(["--grpc-port=8001"])
    message = str(refused.value)
    assert "/opt/tritonserver/bin/tritonserver" in message and "/dev/nvidia0" in message
    assert "trtllm-python-py3" in message  # the container to run it in


def test_in_the_container_several_ranks_run_under_mpirun_one_application_context_each(tmp_path, monkeypatch):
    import pipeline.targets.trtllm.triton_launch as launch_module

    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    two = container_launch(tmp_path, report_with_engine(tmp_path / "two", {"world_size": 2}))
    one = container_launch(tmp_path, report_with_engine(tmp_path / "one", {"world_size": 1}))
    monkeypatch.setattr(launch_module.Path, "exists", lambda self: True)  # NVIDIA's container on a GPU machine
    monkeypatch.setattr(launch_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    command = two(["--grpc-port=8001"])
    assert command[:2] == ["mpirun", "--allow-run-as-root"]
    contexts = " ".join(command[2:]).split(" : ")
    assert len(contexts) == 2 and all(c.startswith("-n 1 /opt/tritonserver/bin/tritonserver ") for c in contexts)
    assert "prefix1_" in contexts[1] and "--load-model=tensorrt_llm" in contexts[1]
    assert one(["--grpc-port=8001"])[0] == "/opt/tritonserver/bin/tritonserver"  # one rank: no mpirun
