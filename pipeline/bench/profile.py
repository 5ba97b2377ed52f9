"""`bench profile`: where our engine's time goes, and what this machine allows at most.

A decode step is split into ONNX Runtime's kernels (their share of a run in its profiler, by operator), ONNX Runtime's
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

from pipeline.errors import PipelineError


def machine_rates(threads: int, repeats: int = 5) -> dict:
    """Memory read bandwidth (GB/s: summing a 1 GiB float32 array, far beyond the caches) and fp32 matrix-product
    rate (GFLOP/s: 2048 x 2048 by 2048 x 2048, torch's and numpy's BLAS; numpy's follows OMP/OPENBLAS thread
    variables, which `make` leaves unset) on `threads` threads, medians of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    big = torch.ones(2**28, dtype=torch.float32)
    big.sum()
    reads = []
    for _ in range(repeats):
        started = time.perf_counter()
        big.sum()
        reads.append(big.numel() * 4 / (time.perf_counter() - started) / 1e9)
    rates = {}
    for library, (a, b) in {
        "torch": (torch.randn(2048, 2048), torch.randn(2048, 2048)),
        "numpy": (np.random.rand(2048, 2048).astype(np.float32), np.random.rand(2048, 2048).astype(np.float32)),
    }.items():
        a @ b
        gemms = []
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            gemms.append(2 * 2048**3 / (time.perf_counter() - started) / 1e9)
        rates[library] = statistics.median(gemms)
    return {
        "read_gb_s": round(statistics.median(reads), 2),
        "sgemm_gflop_s": round(max(rates.values()), 1),  # the better library's: the machine's rate, not one BLAS's
        "sgemm_by_library_gflop_s": {k: round(v, 1) for k, v in rates.items()},
    }


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
    """One generate of `batch` prompts timed as users run it (the prefill, then each decode step's wall time and its
    ONNX Runtime run's), and one more with ONNX Runtime's profiler on, which slows every run: its kernels' share of
    each run (by operator) is applied to the unprofiled run. Medians in ms per decode step."""
    prompts = [[(7 * row + i) % 1000 + 100 for i in range(input_len)] for row in range(batch)]
    with tempfile.TemporaryDirectory() as scratch:
        runner, run_walls = timed_runner(engine_dir, threads, spinning, None)
        list(runner.generate(prompts, max_new_tokens=2, end_id=-1, streaming=True))  # warm-up
        run_walls.clear()
        step_walls, last = [], time.perf_counter()
        for _ in runner.generate(prompts, max_new_tokens=output_len, end_id=-1, streaming=True):
            now = time.perf_counter()
            step_walls.append(now - last)
            last = now
        profiled, profiled_walls = timed_runner(engine_dir, threads, spinning, Path(scratch) / "ort")
        list(profiled.generate(prompts, max_new_tokens=2, end_id=-1, streaming=True))
        profiled_walls.clear()
        list(profiled.generate(prompts, max_new_tokens=output_len, end_id=-1, streaming=True))
        events = json.loads(Path(profiled.session.end_profiling()).read_text())
    kernels = kernel_times(events, len(profiled_walls))
    decode = range(1, len(run_walls))
    ms = lambda values: round(statistics.median(values), 3)  # noqa: E731
    run_ms = ms([run_walls[i] * 1000 for i in decode])
    # the profiler slows every run; its runs give the kernels' share, applied to the unprofiled run
    share = statistics.median(sum(kernels[i].values()) / (profiled_walls[i] * 1000) for i in decode)
    kernels_ms = round(min(1.0, share) * run_ms, 3)
    operators = {
        op: ms([kernels[i].get(op, 0.0) / (profiled_walls[i] * 1000) * run_ms for i in decode]) for op in kernels[1]
    }
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_ms": round(step_walls[0] * 1000, 2),
        "prefill_kernels_share": round(sum(kernels[0].values()) / (profiled_walls[0] * 1000), 3),
        "decode_step_ms": ms([step_walls[i] * 1000 for i in decode]),
        "decode_run_ms": run_ms,
        "decode_kernels_ms": kernels_ms,
        "decode_ort_around_kernels_ms": round(run_ms - kernels_ms, 3),
        "decode_python_ms": ms([(step_walls[i] - run_walls[i]) * 1000 for i in decode]),
        "decode_kernels_by_op_ms": dict(sorted(operators.items(), key=lambda kv: -kv[1])),
    }


# A schema no row completes within any benchmark's output (an array of at least 100,000 strings): every step of every
# row is masked, as in JSON a client asks for, and none ends early.
UNENDING_GUIDE = ("json_schema", '{"type": "array", "items": {"type": "string"}, "minItems": 100000}')


def guided_cost(engine_dir: Path, threads: int, batch: int, input_len: int, output_len: int, spinning: bool) -> dict:
    """Guided decoding's price: the median decode step of `batch` rows unguided, then with a JSON schema on every row
    (the grammar's mask computed and applied per row per step), interleaved over three rounds; ms per step. The
    engine's vocabulary must be able to write JSON (a byte-level BPE, as every real checkpoint's)."""
    from pipeline.targets.onnxruntime.runtime.guided import Guide
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
    from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams

    runner = ModelRunner.from_dir(engine_dir, num_threads=threads, thread_spinning=spinning)
    prompts = [[(7 * row + i) % 1000 + 100 for i in range(input_len)] for row in range(batch)]
    guide = Guide(*UNENDING_GUIDE)

    def decode_steps(guided: bool) -> list[float]:
        requests = [Request(prompt, SamplingParams(max_new_tokens=output_len, end_id=-1)) for prompt in prompts]
        for request in requests if guided else ():
            request.matcher = runner.grammars.matcher(guide)
        walls, last = [], time.perf_counter()
        for _ in runner.run(requests):
            now = time.perf_counter()
            walls.append(now - last)
            last = now
        ended = {r.finish_reason: r.error for r in requests if r.finish_reason != "length"}
        if ended:  # a row that ended early would make the guided steps cheaper than they are
            raise PipelineError(f"guided decoding's measurement: rows ended before {output_len} tokens: {ended}")
        return walls[1:]  # the first is the prefill

    steps = {False: [], True: []}
    decode_steps(True)  # warm-up, and the grammar compiled
    for _ in range(3):
        for guided in (False, True):
            steps[guided] += decode_steps(guided)
    plain, guided = (round(statistics.median(steps[g]) * 1000, 3) for g in (False, True))
    return {"batch": batch, "plain_step_ms": plain, "guided_step_ms": guided, "slower": round(guided / plain - 1, 3)}


def timed_runner(engine_dir: Path, threads: int, spinning: bool, profile_prefix: Path | None):
    """(a ModelRunner of the engine, the list its session's runs append their wall times to); with
    `profile_prefix`, ONNX Runtime's profiler writes there."""
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    runner = ModelRunner.from_dir(
        engine_dir, num_threads=threads, thread_spinning=spinning, profile_prefix=profile_prefix
    )
    session = runner.session
    walls: list[float] = []
    run = session.run_with_iobinding

    def timed(binding, *args):
        started = time.perf_counter()
        run(binding, *args)
        walls.append(time.perf_counter() - started)

    session.run_with_iobinding = timed
    return runner, walls


def kernel_times(events: list[dict], runs: int) -> list[dict[str, float]]:
    """ms of kernel time by operator for each of the last `runs` runs in an ONNX Runtime profile."""
    measured = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-runs:]
    per_run: list[dict[str, float]] = [defaultdict(float) for _ in measured]
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        for index, run in enumerate(measured):
            if run["ts"] <= event["ts"] <= run["ts"] + run["dur"]:
                per_run[index][event["args"]["op_name"]] += event["dur"] / 1000
                break
    return per_run


def ceilings(rates: dict, facts: dict, input_len: int) -> dict:
    """Tokens/s no schedule can pass on this machine: a decode token at the memory bandwidth (batch 1: every weight
    read for one token), a prefill token at the fp32 matrix-product rate."""
    return {
        "decode_batch1_tok_s": round(rates["read_gb_s"] * 1e9 / facts["decode_bytes_per_token"], 1),
        "prefill_tok_s_at_sgemm_rate": round(rates["sgemm_gflop_s"] * 1e9 / facts["prefill_flops_per_token"], 1),
        "input_len": input_len,
    }
