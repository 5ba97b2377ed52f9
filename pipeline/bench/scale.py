"""`bench scale`: what every build stage costs at real model sizes (peak host memory, CPU-seconds, wall time, disk,
bytes per parameter) on random-weight Llama checkpoints of real shapes, each stage in its own process, beside the
memory plan's prediction.

Why (issue #46): everything else is measured on one 135M model, and a stage that holds a whole model in memory only
shows it at 1B and up. Random weights are enough for memory and time: what a stage holds and does depends on the
shapes, not on the values. Their answers are noise, so the quality gate's thresholds are relaxed to what a random
model meets; what the gate computes (`eval_tokens`, the chat set) stays what a user's build computes.

Peak memory is the anonymous RSS (`RssAnon` of /proc/PID/status: heap, not the mapped checkpoint a kernel may drop)
of the stage's process and its children, summed and sampled every 50 ms, keeping the maximum; the kernel's own
high-water mark (`ru_maxrss`: VmHWM of the largest process, file-backed pages included) is kept beside it. Results
are kept per size and target, so a run that stops resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A Llama checkpoint's sizes; the vocabulary is the tokenizer's (SmolLM2's: 49,152)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    about: str = ""
    full_depth: bool = True  # a real model's depth: its CPU-seconds per billion parameters are compared


SIZES = {
    "0.5b": Shape(1024, 4096, 28, 16, 4, True, "about 0.48B parameters with SmolLM2's vocabulary"),
    "1.1b": Shape(2048, 5632, 22, 32, 4, False, "TinyLlama-1.1B's shape"),
    "3b": Shape(3072, 8192, 28, 24, 8, True, "Llama-3.2-3B's widths and depth"),
    "8b-2l": Shape(
        4096, 14336, 2, 32, 8, False, "Llama-3.1-8B's widths, 2 layers: a layer's memory at real width", False
    ),
}


@dataclass(frozen=True)
class TargetBuild:
    """The shipped config a target is built from, the stage it stops after (trtllm's engine needs a GPU), and
    whether its Triton repository serves on this machine (then it is served once built)."""

    config: Path
    until: str | None = None
    serves: bool = False


TARGETS = {
    "onnxruntime": TargetBuild(Path("build_configs/smollm2-135m-cpu.yaml"), serves=True),
    "trtllm": TargetBuild(Path("build_configs/smollm2-135m-fp8.yaml"), until="export"),
}
# What a random model meets: its answers are noise, so the engine's agree with the reference's by chance only. Only
# the thresholds a config sets are relaxed (a null one stays null, so the chat set runs exactly where a user's does).
RELAXED_GATE = dict(
    max_perplexity_increase=10.0, max_kl_divergence=10.0, min_top1_agreement=0.0, min_chat_answer_match=0.0
)
# The first line the quality gate logs (`pipeline.quality.measure`): from it to the stage's end is the gate's time.
GATE_STARTS = ("scoring ", " tokens of ")
GATE = "the quality gate"
# What a stage does from the log line holding these words on, and whether that part runs a model (the issue's
# targets: a part that only converts and writes weights holds at most 0.5 B/param beyond its libraries, one that
# runs a model one float32 copy); before the first: starting (imports, reading the config and headers).
PHASES = (
    (("copying ", " tensors into "), "copying the tensors", False),
    (("dequantizing ", " tensors into "), "dequantizing the tensors", False),
    (("building the fused graph",), "writing the ONNX graph", False),
    (("exporting the decoder with optimum",), "writing the ONNX graph", False),
    (("comparing ONNX Runtime logits",), "the export's logits check", True),
    (("SmoothQuant: alpha",), "calibration", True),
    (("GPTQ: int4",), "calibration", True),
    (("quantizing the weights one at a time",), "quantization", False),
    (("ModelOpt: ",), "calibration", True),
    (("exporting a ", "unified HF checkpoint"), "the unified export", False),
    (GATE_STARTS, GATE, True),
)
STARTING = "starting"
# The served check of a built repository: a few short streamed completions through our OpenAI gateway.
SERVE_REQUESTS, SERVE_TOKENS = 4, 16
SERVE_ARGS = ["--protocol", "openai", "--concurrency", "1", "--requests", str(SERVE_REQUESTS)]
SERVE_ARGS += ["--output-len", str(SERVE_TOKENS)]
SAMPLE_SECONDS = 0.05
IGNORE_MEMORY_CHECK = "--ignore-memory-check"
DEFAULT_CONFIG = Path("build_configs/smollm2-135m-cpu.yaml")  # its import holds SmolLM2's tokenizer


# --- checkpoints -------------------------------------------------------------------------------------------------


def smollm2_tokenizer(work: Path, log: Callable[[str], None]) -> Path:
    """SmolLM2's tokenizer files: the default build's import stage, built into `work` once (about 15 s)."""
    output = work / "smollm2-import"
    log(f"SmolLM2's tokenizer: {DEFAULT_CONFIG} --until import into {output}")
    command = [sys.executable, "-m", "pipeline.cli", "build", str(REPO / DEFAULT_CONFIG), "-o", str(output)]
    done = subprocess.run([*command, "--until", "import"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building SmolLM2's import for its tokenizer failed:\n{done.stdout}{done.stderr}")
    return output / "import"


def make_checkpoint(shape: Shape, tokenizer_dir: Path, path: Path, seed: int = 0) -> Path:
    """A random bfloat16 Llama checkpoint of `shape` with the tokenizer of `tokenizer_dir`, made without an fp32
    copy: built on the meta device, given empty bfloat16 storage and filled tensor by tensor (small normals, norm
    scales 1), seeded. One already at `path` is reused."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = {key: value for key, value in asdict(shape).items() if key != "about"}
    config = LlamaConfig(
        **sizes,
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in model.named_parameters():  # tied ones once
            if parameter.ndim == 1:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, config.initializer_range, generator=generator)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def parameter_count(checkpoint: Path) -> int:
    """Parameters stored in the checkpoint's safetensors (a tied embedding once), read from their headers."""
    from safetensors import safe_open

    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as tensors:
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return total


# --- configs and the plan's prediction ---------------------------------------------------------------------------


def build_overrides(config: Path, checkpoint: Path, calibration_samples: int | None, extra: list[str]) -> list[str]:
    """The command line's overrides of a target's shipped config for one checkpoint: the model, the relaxed gate
    (only the thresholds the config sets), the trtllm calibration size, then the user's own."""
    from pipeline.validation import load_config

    overrides = ["model.source=hf", f"model.path={checkpoint.resolve()}"]
    if calibration_samples is not None:
        overrides.append(f"quantization.calibration.num_samples={calibration_samples}")
    verify = load_config(REPO / config, overrides + extra).verify
    relaxed = [f"verify.{key}={value}" for key, value in RELAXED_GATE.items() if getattr(verify, key) is not None]
    return overrides + relaxed + extra


def seq_len(config: Path, overrides: list[str]) -> int | None:
    """The calibration sequence length a target's build used (None when it calibrates nothing)."""
    from pipeline.validation import load_config

    calibration = load_config(REPO / config, overrides).quantization.calibration
    return calibration.seq_len if calibration else None


def predicted(config: Path, overrides: list[str], log: Callable[[str], None]) -> dict[str, dict]:
    """Stage -> the plan's predicted host and disk bytes (`pipeline.host_memory.predict`), or {} where it cannot
    predict this config: a measurement is never lost to a prediction."""
    from pipeline.host_memory import predict
    from pipeline.validation import load_config

    try:
        stages = predict(load_config(REPO / config, overrides))
        return {name: {"host_bytes": p.host_bytes, "disk_bytes": p.disk_bytes} for name, p in stages.items()}
    except Exception as exc:  # noqa: BLE001 - the prediction is a column beside the measurement
        log(f"no prediction: {type(exc).__name__}: {exc}")
        return {}


# --- measuring one stage -----------------------------------------------------------------------------------------


def status_kib(pid: int, field: str) -> int:
    """A `kB` field of /proc/PID/status (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return 0


def tree_anon_bytes(pid: int) -> int:
    """RssAnon of a process and all its descendants, summed."""
    import psutil

    try:
        pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return 0
    return 1024 * sum(status_kib(each, "RssAnon") for each in pids)


def phase_of(line: str) -> tuple[str, bool] | None:
    """(the phase a log line starts, whether it runs a model), or None when it starts none."""
    return next(((name, runs) for words, name, runs in PHASES if all(word in line for word in words)), None)


def phase_peaks(samples: list[tuple[float, int]], starts: list[tuple[float, str, bool]], wall: float) -> list[dict]:
    """Each phase's start, seconds and peak anonymous RSS, from the samples taken while it ran (a phase starting
    again, as the gate's models do, continues the one before)."""
    bounds = [(0.0, STARTING, False)] + [s for i, s in enumerate(starts) if i == 0 or s[1] != starts[i - 1][1]]
    phases = []
    for number, (start, name, runs_model) in enumerate(bounds):
        end = bounds[number + 1][0] if number + 1 < len(bounds) else wall
        peak = max((anon for at, anon in samples if start <= at < end), default=0)
        phases.append(
            {"phase": name, "runs_model": runs_model, "start_s": round(start, 2), "seconds": round(end - start, 2)}
            | {"peak_anon_bytes": peak}
        )
    return phases


def measure_process(command: list[str], log_file: Path, env: dict | None = None) -> dict:
    """Run `command`, its output timestamped into `log_file`, sampling its process tree's anonymous RSS every 50 ms:
    wall seconds, CPU seconds (user + system of it and its waited-for children, from wait4), the sampled peak, the
    kernel's ru_maxrss, the exit code (negative: killed by that signal), when the quality gate began, and the peak
    of each phase its log names (`PHASES`)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})},
    )
    samples, done, starts, tail = [], threading.Event(), [], []

    def sample():
        while not done.is_set():
            samples.append((time.monotonic() - started, tree_anon_bytes(process.pid)))
            done.wait(SAMPLE_SECONDS)

    def copy_output():
        with open(log_file, "w") as out:
            for line in process.stdout:
                offset = time.monotonic() - started
                if phase := phase_of(line):
                    starts.append((offset, *phase))
                out.write(f"[{offset:8.1f}s] {line}")
                tail[:] = [*tail[-29:], line.rstrip()]

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=copy_output, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        done.set()
    wall = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    for thread in threads:
        thread.join(timeout=10)
    gate = next((at for at, name, _ in starts if name == GATE), None)
    return {
        "returncode": process.returncode,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_anon_bytes": max((anon for _, anon in samples), default=0),
        "ru_maxrss_bytes": usage.ru_maxrss * 1024,
        "gate_s": None if gate is None else round(wall - gate, 2),
        "phases": phase_peaks(samples, starts, wall),
        "log_tail": tail,
    }


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path`, each hard-linked file once."""
    seen, total = set(), 0
    for file in path.rglob("*") if path.exists() else ():
        info = file.lstat()
        if file.is_file() and not file.is_symlink() and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            total += info.st_size
    return total


def failure(returncode: int) -> str:
    """An exit status in words: a SIGKILL is most likely the kernel's OOM killer, exit 4 the plan's preflight."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exit {returncode}" + (" (this machine cannot: predicted not to fit)" if returncode == 4 else "")


# --- one size on one target --------------------------------------------------------------------------------------


def measure_target(
    size: str,
    target: str,
    checkpoint: Path,
    output: Path,
    logs: Path,
    overrides: list[str],
    log,
    check_memory: bool = True,
) -> dict:
    """Every stage of `target`'s build of `checkpoint`, each in its own process into a fresh `output`; a stage that
    fails ends the target (the later ones read its output)."""
    from pipeline.stages import STAGES, selected
    from pipeline.validation import load_config

    build = TARGETS[target]
    cfg = load_config(REPO / build.config, overrides)
    prediction = predicted(build.config, overrides, log)
    shutil.rmtree(output, ignore_errors=True)
    stages, failed = [], None
    for name in selected(build.until):
        row = {"stage": name}
        skipped = STAGES[name].applies(cfg)
        if skipped or failed:
            stages.append(row | {"status": "skipped" if skipped else "not run", "reason": skipped or failed})
            continue
        log(f"{size} {target}: {name}")
        command = [sys.executable, "-m", "pipeline.bench.scale", name, str(REPO / build.config), str(output)]
        command += [] if check_memory else [IGNORE_MEMORY_CHECK]
        measured = measure_process(command + overrides, logs / f"{target}-{name}.log")
        row |= measured | {"status": "ok" if measured["returncode"] == 0 else "failed"}
        if measured["returncode"] != 0:
            failed = f"{name} failed: {failure(measured['returncode'])}: {last_line(measured)}"
            row["reason"] = failed
            log(f"{size} {target}: {failed}; log: {logs / f'{target}-{name}.log'}")
        else:
            del row["log_tail"]
            row["disk_bytes"] = disk_bytes(output / name)
            lock = json.loads((output / "build.lock.json").read_text())
            row["metrics"] = lock["stages"].get(name, {}).get("metrics", {})
            log(
                f"{size} {target}: {name} {row['wall_s']:.0f} s, {row['cpu_s']:.0f} CPU-s, "
                f"peak anon {row['peak_anon_bytes'] / GIB:.2f} GiB, disk {row['disk_bytes'] / GIB:.2f} GiB"
            )
        row["predicted"] = prediction.get(name)
        stages.append(row)
    if build.serves and not failed:
        served = serve_once(output, logs / f"{target}-serve.log")
        stages.append(served)
        failed = served.get("reason")
        log(f"{size} {target}: {failed or 'served: ' + served['answered']}")
    return {
        "status": "failed" if failed else "ok",
        "config": str(build.config),
        "overrides": overrides,
        "stages": stages,
        "build_disk_bytes": disk_bytes(output),
    }


def last_line(measured: dict) -> str:
    """The last line a measured process printed (the error a failed stage ends on), cut to 300 characters."""
    return next((line.strip() for line in reversed(measured["log_tail"]) if line.strip()), "")[:300]


def serve_once(output: Path, log_file: Path) -> dict:
    """The built repository served by tritonserver with our OpenAI gateway (`bench serve`, a server of its own),
    a few streamed completions measured: the row of stage `serve` (its process tree: the server and every model)."""
    report = output / "serve-report"
    command = [sys.executable, "-m", "pipeline.cli", "bench", "serve", str(output / "triton_repo"), "-o", str(output)]
    measured = measure_process([*command, *SERVE_ARGS, "--out", str(report)], log_file)
    row = {"stage": "serve"} | measured
    results = report / "latest-serve" / "results.json"
    summary = json.loads(results.read_text())["levels"][0]["summary"] if results.is_file() else None
    if measured["returncode"] != 0 or not summary:
        return row | {
            "status": "failed",
            "reason": f"serve failed: {failure(measured['returncode'])}: {last_line(row)}",
        }
    if summary["errors"] or summary["requests"] != SERVE_REQUESTS:
        answered = summary["requests"] - summary["errors"]
        return row | {
            "status": "failed",
            "reason": f"served {answered} of {SERVE_REQUESTS} completions: {last_line(row)}",
        }
    del row["log_tail"]
    answered = (
        f"{SERVE_REQUESTS} streamed completions of {SERVE_TOKENS} tokens, none failed, TTFT p50 "
        f"{summary['ttft_ms']['p50']:.0f} ms, {summary['output_token_throughput']:.1f} output tokens/s"
    )
    return row | {"status": "ok", "answered": answered, "serving": summary, "disk_bytes": 0}


def source_commit() -> str:
    """The commit measured (`git describe --always --dirty`), or "unknown" outside a git checkout."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git here: the measurement is kept all the same
        return "unknown"
    return done.stdout.strip() or "unknown"


def result_path(out: Path, size: str, target: str) -> Path:
    return out / size / f"{target}.json"


def measured_already(out: Path, size: str, target: str) -> bool:
    """Measured with every stage done: a failed one is tried again (after a fix, or with more memory free)."""
    path = result_path(out, size, target)
    return path.is_file() and json.loads(path.read_text()).get("status") == "ok"


def run_scale(
    sizes: list[str],
    targets: list[str],
    out: Path,
    work: Path,
    *,
    tokenizer: Path | None = None,
    force: bool = False,
    keep_checkpoints: bool = False,
    calibration_samples: int | None = 16,
    extra: list[str] = (),
    check_memory: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Measure every size x target not measured yet or failed (all with `force`), a size at a time: make its
    checkpoint, build and measure each target, delete the build before the next, the checkpoint too unless
    `keep_checkpoints`. `check_memory` False runs the stages the plan predicts will not fit. Returns every result."""
    from pipeline.bench.report import machine_info, write_json

    unknown = [name for name in sizes if name not in SIZES] + [name for name in targets if name not in TARGETS]
    if unknown:
        raise PipelineError(f"unknown {', '.join(unknown)}: sizes are {', '.join(SIZES)}; targets {', '.join(TARGETS)}")
    tokenizer_given = tokenizer
    for size in sizes:
        pending = [t for t in targets if force or not measured_already(out, size, t)]
        for target in sorted(set(targets) - set(pending)):
            log(f"{size} {target}: measured already ({result_path(out, size, target)}; --force measures again)")
        if not pending:
            continue
        tokenizer = tokenizer or smollm2_tokenizer(work, log)
        checkpoint = work / "checkpoints" / size
        log(f"{size}: random checkpoint {SIZES[size]} in {checkpoint}")
        started = time.monotonic()
        # in a process of its own: this one stays small (no torch) while the stages it measures run beside it
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(make_checkpoint, SIZES[size], tokenizer, checkpoint).result()
        made_s, params = round(time.monotonic() - started, 1), parameter_count(checkpoint)
        log(f"{size}: {params / 1e9:.3f}B parameters ({made_s:.0f} s)")
        (out / size / "shape").mkdir(parents=True, exist_ok=True)  # for predictions once the checkpoint is gone
        shutil.copy2(checkpoint / "config.json", out / size / "shape" / "config.json")
        for target in pending:
            samples = calibration_samples if target == "trtllm" else None
            overrides = build_overrides(TARGETS[target].config, checkpoint, samples, list(extra))
            output = work / f"{size}-{target}"
            try:
                logs = out / size / "logs"
                result = measure_target(size, target, checkpoint, output, logs, overrides, log, check_memory)
            finally:
                shutil.rmtree(output, ignore_errors=True)  # disk is tight: a 3B CPU build writes 20.7 GB
            result |= {
                "size": size,
                "target": target,
                "shape": asdict(SIZES[size]),
                "parameters": params,
                "checkpoint_seconds": made_s,
                "tokenizer": "SmolLM2's" if tokenizer_given is None else str(tokenizer_given),
                "trtllm_calibration_samples": samples,
                "trtllm_calibration_seq_len": seq_len(TARGETS[target].config, overrides) if samples else None,
                "commit": source_commit(),
                "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": machine_info(),
            }
            write_json(result_path(out, size, target), result)
        if not keep_checkpoints:
            shutil.rmtree(checkpoint, ignore_errors=True)
    return load_results(out)


def load_results(out: Path) -> list[dict]:
    """Every stored result, smallest model first."""
    results = [json.loads(path.read_text()) for path in sorted(out.glob("*/*.json"))]
    return sorted(results, key=lambda r: (r["parameters"], r["target"]))


def repredict(out: Path, work: Path, results: list[dict], log) -> None:
    """The predictions again from today's plan (`--report-only`): against the kept checkpoint, else its config.json."""
    for result in results:
        checkpoint = work / "checkpoints" / result["size"]
        shape = checkpoint if (checkpoint / "config.json").is_file() else out / result["size"] / "shape"
        overrides = [
            o if not o.startswith("model.path=") else f"model.path={shape.resolve()}" for o in result["overrides"]
        ]
        fresh = predicted(Path(result["config"]), overrides, log)
        for row in result["stages"]:
            row["predicted"] = fresh.get(row["stage"], row.get("predicted"))


def run_one_stage(argv: list[str]) -> int:
    """`python -m pipeline.bench.scale STAGE CONFIG OUTPUT [OVERRIDES...] [--ignore-memory-check]`: one stage of a
    build, in this process alone, as `trtllm-pipeline build` runs it."""
    from rich.console import Console

    from pipeline.build import build
    from pipeline.errors import PipelineError
    from pipeline.validation import load_config

    check = {"check_memory": False} if IGNORE_MEMORY_CHECK in argv else {}
    stage, config, output, *overrides = [arg for arg in argv if arg != IGNORE_MEMORY_CHECK]
    console = Console(width=200)
    try:
        build(load_config(config, overrides), Path(output), console, only=stage, **check)
    except PipelineError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(run_one_stage(sys.argv[1:]))
