"""The parent side of an engine worker (`protocol`): start it, send requests, sample its memory while it works."""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipeline.bench.peers import EngineSpec
from pipeline.errors import PipelineError


class WorkerError(PipelineError):
    pass


@contextmanager
def alone(engine, engines: list):
    """Every other engine's worker stopped (SIGSTOP) while `engine` works: an idle engine's threads (OpenMP's, a
    spinning thread pool's) cannot take cycles from the one being timed."""
    import psutil

    processes = [getattr(e, "process", None) for e in engines if e is not engine]
    stopped = [psutil.Process(p.pid) for p in processes if p is not None and p.poll() is None]
    for process in stopped:
        process.suspend()
    try:
        yield engine
    finally:
        for process in stopped:
            process.resume()


class Worker:
    """One engine in its own process. `peak_rss_mib` is the largest resident set seen while it generated."""

    def __init__(self, spec: EngineSpec, threads: int, log_dir: Path, timeout_s: float = 1800):
        self.spec, self.timeout_s, self.peak_rss_mib = spec, timeout_s, 0.0
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec.name.replace(' ', '_').replace('/', '_')}.log"
        self.stderr = self.log_path.open("w")
        self.process = subprocess.Popen(
            spec.command(threads),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=spec.environment(),
            text=True,
        )
        self.facts = self.answer()["ready"]
        self.scratch = tempfile.TemporaryDirectory(prefix="peer-logits-")

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise WorkerError(f"{self.spec.name}: the worker exited ({self.process.wait()}); {self.log_tail()}")
        message = json.loads(line)
        if "error" in message:
            raise WorkerError(f"{self.spec.name}: {message['error']}; {self.log_tail()}")
        return message

    def log_tail(self) -> str:
        self.stderr.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return f"its log ({self.log_path}) ends: " + " | ".join(lines) if lines else f"its log {self.log_path} is empty"

    def call(self, op: str, **request) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.process.stdin.flush()
        return self.answer()["result"]

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        import psutil

        process, stop = psutil.Process(self.process.pid), threading.Event()

        def sample():
            while not stop.is_set():
                self.peak_rss_mib = max(self.peak_rss_mib, process.memory_info().rss / 2**20)
                stop.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = self.call("generate", prompts=prompts, output_len=output_len)
        finally:
            stop.set()
            sampler.join()
        return result["ttft_s"], result["total_s"]

    def warm_up(self, prompts: list[list[int]]) -> None:
        """First-call allocations and kernel selection, untimed."""
        self.generate(prompts, 2)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """[1, n, vocab] logits for int64 ids [1, n]: the quality gate's `LogitsFn`."""
        path = Path(self.scratch.name) / "logits.npy"
        self.call("logits", ids=[int(t) for t in np.ravel(ids)], path=str(path))
        return np.load(path)[None]

    def greedy(self, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
        return self.call("greedy", prompt=list(prompt), max_new_tokens=max_new_tokens, end_id=end_id)["tokens"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()
        self.scratch.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
