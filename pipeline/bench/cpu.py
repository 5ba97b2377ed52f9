"""Where a served load's CPU time goes: seconds of CPU per process of the server `bench serve` started (tritonserver,
each model's python-backend process), of the benchmark process itself (for protocol openai, the gateway's thread)
and of the load generator's process, read from the kernel's counters around each level. `bench profile` splits the
engine's decode step inside its process; this splits the machine between the processes around it."""

from __future__ import annotations

import os

import psutil

BENCH_PROCESS = "bench process (OpenAI gateway)"
LOAD_GENERATOR = "load generator"  # a process of its own (pipeline.bench.serve.load_generator), which counts itself


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_seconds(server) -> dict[str, float]:
    """Seconds of CPU used so far by each process of a started TritonServer (its model processes by model name)
    and by this process."""
    processes = {psutil.Process(server.process.pid): "tritonserver", psutil.Process(): BENCH_PROCESS}
    processes |= {stub: f"model {model}" for stub, model in server.stubs.items()}
    seconds: dict[str, float] = {}
    for process, label in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:  # exited: its share is no longer counted
            continue
        seconds[label] = seconds.get(label, 0.0) + times.user + times.system
    return seconds


def cpu_split(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict:
    """CPU seconds per process over a level, and how busy they kept the machine's cores (1.0: every usable core
    all the time)."""
    seconds = {label: round(after[label] - before.get(label, 0.0), 2) for label in after}
    capacity = duration_s * usable_cpus()
    return {"seconds": seconds, "busy": round(sum(seconds.values()) / capacity, 3) if capacity else None}
