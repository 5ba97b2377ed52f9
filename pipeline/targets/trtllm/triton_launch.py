"""How a repository of Triton's C++ `tensorrtllm` backend is served: NVIDIA's TensorRT-LLM container's
tritonserver, one MPI rank per GPU of the engine, as tensorrtllm_backend's launch_triton_server.py starts them. The
generic server (`pipeline.triton.server.TritonServer`) takes `launch` from here; the deployment
(`pipeline.targets.trtllm.deployment`) takes the ranks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import TargetUnavailable

CONTAINER_TRITON = Path("/opt/tritonserver")  # NVIDIA's tritonserver:<version>-trtllm-python-py3 image


def tensorrtllm_world_size(report) -> tuple[str | None, int]:
    """(the repository's tensorrtllm model, its engine's GPU world size), or (None, 0) when it has none."""
    names = [name for name, config in report.models.items() if config.backend == "tensorrtllm"]
    if not names:
        return None, 0
    engine = Path(report.models[names[0]].parameters["gpt_model_path"].string_value) / "config.json"
    mapping = json.loads(engine.read_text()).get("pretrained_config", {}).get("mapping", {})
    return names[0], int(mapping.get("world_size", mapping.get("tp_size", 1) * mapping.get("pp_size", 1)))


def tritonserver_ranks(
    repo: str, address_args: list[str], world_size: int, llm_model_name: str, followers: list[str] = ()
) -> list[list[str]]:
    """One tritonserver command per rank: rank 0 serves the repository, the others only their shard of the engine
    (plus `followers`, e.g. no ports of their own)."""
    ranks = []
    for rank in range(world_size):
        args = [
            str(CONTAINER_TRITON / "bin" / "tritonserver"),
            f"--model-repository={repo}",
            *address_args,
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
        ]
        if rank:
            args += ["--model-control-mode=explicit", f"--load-model={llm_model_name}", *followers]
        ranks.append(args)
    return ranks


def container_launch(repo: Path, report) -> Callable[[list[str]], list[str]] | None:
    """The tritonserver command of a repository holding a tensorrtllm model, for given address arguments (None for
    any other repository); raises TargetUnavailable outside NVIDIA's container on a GPU machine."""
    llm_model_name, world_size = tensorrtllm_world_size(report)
    if llm_model_name is None:
        return None

    def command(address_args: list[str]) -> list[str]:
        missing = [
            p
            for p in (CONTAINER_TRITON / "bin" / "tritonserver", CONTAINER_TRITON / "backends" / "tensorrtllm")
            if not p.exists()
        ]
        if not Path("/dev/nvidia0").exists():
            missing.append(Path("/dev/nvidia0 (an NVIDIA GPU)"))
        if world_size > 1 and not shutil.which("mpirun"):
            missing.append(Path("mpirun"))
        if missing:
            raise TargetUnavailable(
                f"{repo} uses Triton's tensorrtllm backend; serving it needs "
                + ", ".join(map(str, missing))
                + " -- run this inside NVIDIA's tritonserver:<tag>-trtllm-python-py3 "
                "container on a GPU machine (the Dockerfile's gpu target builds one)"
            )
        ranks = tritonserver_ranks(str(repo), address_args, world_size, llm_model_name)
        if world_size == 1:
            return ranks[0]
        launched = ["mpirun", "--allow-run-as-root"]
        for rank, args in enumerate(ranks):
            launched += ["-n", "1", *args] + ([":"] if rank < len(ranks) - 1 else [])
        return launched

    return command
