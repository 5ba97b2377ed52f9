"""How an onnxruntime build runs in a container (`pipeline.k8s`): `trtllm-pipeline serve` in the CPU image of our
Dockerfile, which builds the config into the image.

Apart from the adapter (`adapter.py`) so that the build stages, whose lock entries hash the adapter and what it
imports, do not re-run when only the deployment changes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.docker import image_build
from pipeline.host_memory import build_peak_bytes
from pipeline.k8s import QueueMetric, Serving, triton_health, triton_port_flags, triton_serve_command
from pipeline.k8s_names import ascii_name
from pipeline.targets.onnxruntime.runtime.scheduler import METRIC_PREFIX
from pipeline.targets.onnxruntime.serving_memory import plan_cpu_serving

# /dev/shm of a CPU server pod: the python backend's tensor regions, one per model instance (default 1 MiB, growing by
# 1 MiB; the server's tensors are token ids and text), well under this cap (a memory-backed emptyDir holds only what is
# written, but the pod's memory request and limit count it).
CPU_SHM_BYTES = 256 << 20


def serving(cfg) -> Serving:
    facts = cfg.model_facts()
    plan = plan_cpu_serving(cfg, facts) if facts else None
    config = cfg.source or Path("CONFIG.yaml")
    # a Docker tag: at most 128 ASCII letters, digits, '_', '.' or '-', not starting with '.' or '-'
    tag = f"trtllm-pipeline:{ascii_name(config.stem.lower(), 'a-z0-9_.-').lstrip('.-')[:128] or 'config'}"
    return Serving(
        image=tag,
        image_build=image_build(cfg, None, tag).shown(),
        artifacts="image",
        image_problem=None,
        port_flags=triton_port_flags(cfg),
        unauthenticated="Triton HTTP and gRPC: run the served models and pick an adapter by lora_task_id; no "
        "request loads files or registers an adapter (those come from the build and the gateway's keyed route)",
        health=triton_health(),
        metrics=("metrics", "/metrics"),
        queue_metric=QueueMetric(
            f"{METRIC_PREFIX}queued_requests", "pipeline/targets/onnxruntime/runtime/scheduler.py GAUGES"
        ),
        queue_problem=None,
        gpus=0,
        memory_bytes=plan.total_bytes if plan else 0,
        memory_lines=plan.lines() if plan else [],
        build_memory_bytes=build_peak_bytes(cfg),
        shm_bytes=CPU_SHM_BYTES,
        cpus=cfg.deploy.cpus or 2,
        command=lambda paths: triton_serve_command(cfg, paths),
        group_problem="the onnxruntime target runs on one machine",
    )
