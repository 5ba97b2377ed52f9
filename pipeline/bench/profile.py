"""`bench profile`: where our engine's time goes, and what this machine allows at most.

A decode step is split into ONNX Runtime's kernels (the sum of its profiler's per-node kernel times), ONNX Runtime's
own work around them (the run's wall time less its kernels: the executor, input binding, output allocation, and
waking the thread pool, which a kernel's parallel loop waits on), and Python (the step's wall time less the run:
sampling, the scheduler, building the binding's inputs). Triton's IPC is the served inter-token latency at one
request less the offline step (measured by `bench serve --concurrency 1`, not here).

The ceilings: a decode token reads every weight once (the embedding one row), so its time is at least the weights'
bytes over the memory bandwidth; a prefill token does two flops per weight of a matrix product, so its time is at
least that over the machine's matrix-product rate. Both rates are measured here with torch on the same threads.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def machine_rates(threads: int, repeats: int = 5) -> dict:
    """Memory read bandwidth (GB/s: summing a 1 GiB float32 array, far beyond the caches) and fp32 matrix-product
    rate (GFLOP/s: 2048 x 2048 by 2048 x 2048) on `threads` threads, medians of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    big = torch.ones(2**28, dtype=torch.float32)
    big.sum()
    reads = []
    for _ in range(repeats):
        started = time.perf_counter()
        big.sum()
        reads.append(big.numel() * 4 / (time.perf_counter() - started) / 1e9)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    gemms = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        gemms.append(2 * 2048**3 / (time.perf_counter() - started) / 1e9)
    return {"read_gb_s": round(statistics.median(reads), 2), "sgemm_gflop_s": round(statistics.median(gemms), 1)}


def weight_facts(onnx_path: Path) -> dict:
    """Bytes a decode token reads (every initializer but the embedding table, of which one row) and matrix-product
    weights (each K x N weight of a MatMul or MatMulNBits: two flops each per token)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    sizes = {}
    for init in graph.initializer:
        shape = list(init.dims)
        size = int(np.prod(shape)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        sizes[init.name] = (size, shape)
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in sizes}
    matmul_weights = 0
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            matmul_weights += attrs["K"] * attrs["N"]
        elif node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in sizes:
            matmul_weights += int(np.prod(sizes[node.input[1]][1]))
    per_token = sum(size // shape[0] if name in gathered and shape else size for name, (size, shape) in sizes.items())
    return {
        "decode_bytes_per_token": per_token,
        "matmul_weights": matmul_weights,
        "prefill_flops_per_token": 2 * matmul_weights,
    }


def step_split(engine_dir: Path, threads: int, batch: int, input_len: int, output_len: int, spinning: bool) -> dict:
    """One generate of `batch` prompts with ONNX Runtime's profiler on: the prefill's time and each decode step's
    median split (ms) into kernels, ONNX Runtime around them, and Python, with the kernels by operator."""
    import onnxruntime as ort

    from pipeline.runtime.model_runner import ONNX_FILE, ModelRunner

    config = json.loads((engine_dir / "config.json").read_text())
    built = config["build_config"]
    with tempfile.TemporaryDirectory() as scratch:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "ort")
        session = ort.InferenceSession(str(engine_dir / ONNX_FILE), options, providers=["CPUExecutionProvider"])
        runner = ModelRunner(
            engine_dir,
            config,
            session,
            max_batch_size=built["max_batch_size"],
            max_input_len=built["max_input_len"],
            max_seq_len=built["max_seq_len"],
            max_beam_width=1,
        )
        run_walls = []
        original = session.run_with_iobinding

        def timed(binding, *args):
            started = time.perf_counter()
            original(binding, *args)
            run_walls.append(time.perf_counter() - started)

        session.run_with_iobinding = timed
        prompts = [[(7 * row + i) % 1000 + 100 for i in range(input_len)] for row in range(batch)]
        list(runner.generate(prompts, max_new_tokens=2, end_id=-1, streaming=True))  # warm-up
        run_walls.clear()
        step_walls, last = [], time.perf_counter()
        for _ in runner.generate(prompts, max_new_tokens=output_len, end_id=-1, streaming=True):
            now = time.perf_counter()
            step_walls.append(now - last)
            last = now
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    measured = runs[-len(run_walls) :]  # the profiled generate's runs (the warm-up's come first)
    per_run, by_op = [0.0] * len(measured), defaultdict(list)
    for kernel in kernels:
        for index, run in enumerate(measured):
            if run["ts"] <= kernel["ts"] <= run["ts"] + run["dur"]:
                per_run[index] += kernel["dur"] / 1000
                if index:
                    by_op[(index, kernel["args"]["op_name"])].append(kernel["dur"] / 1000)
                break
    decode = range(1, len(run_walls))
    ms = lambda values: round(statistics.median(values), 3)  # noqa: E731
    operators = defaultdict(list)
    for (index, op), durations in by_op.items():
        operators[op].append(sum(durations))
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_ms": round(step_walls[0] * 1000, 2),
        "prefill_kernels_ms": round(per_run[0], 2),
        "decode_step_ms": ms([step_walls[i] * 1000 for i in decode]),
        "decode_kernels_ms": ms([per_run[i] for i in decode]),
        "decode_ort_around_kernels_ms": ms([run_walls[i] * 1000 - per_run[i] for i in decode]),
        "decode_python_ms": ms([(step_walls[i] - run_walls[i]) * 1000 for i in decode]),
        "decode_kernels_by_op_ms": {op: ms(v) for op, v in sorted(operators.items(), key=lambda kv: -sum(kv[1]))},
    }
