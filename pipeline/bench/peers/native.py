"""llama.cpp timed by its own tools, beside its bindings worker: `llama-bench` at batch 1 (prompt processing `-p N
-n 0`, generation `-p 0 -n M -d N`: M tokens decoded after a context of N) and `llama-batched-bench` at larger
batches (`-npp N -ntg M -npl B`), with the same threads and each tool's own repetitions and warm-up, as llama.cpp's
maintainers publish their numbers. A tool times its own random tokens of the same lengths; speed does not depend on
which tokens they are.

`NativeTimer` stands in the offline benchmark's rotation as a `Worker` does (`alone`, `warm_up`, `generate`), its
timings given as the (time to first token, total time) of one run, so every engine's row is computed alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

from pipeline.bench.peers import EngineSpec, peer_environment
from pipeline.errors import PipelineError

TOOLS = ("llama-bench", "llama-batched-bench")  # the manifest's tool names (pipeline.bench.peers.build)
BENCH_REPETITIONS = 5  # llama-bench's default `-r`


class NativeToolError(PipelineError):
    pass


class NativeTimer:
    """One llama.cpp GGUF (the bindings worker's `spec`) timed by llama.cpp's tools in `tools` (name -> path)."""

    def __init__(self, spec: EngineSpec, tools: dict[str, str], threads: int, log_dir: Path):
        missing = [t for t in TOOLS if not Path(tools.get(t, "")).is_file()]
        if missing:
            raise NativeToolError(f"{', '.join(missing)} not built: run `trtllm-pipeline bench peers CONFIG` again")
        self.spec = dataclasses.replace(spec, name=f"{spec.name} (its tools)", options={"timed by": ", ".join(TOOLS)})
        self.tools, self.threads = tools, threads
        self.peak_rss_mib = 0.0
        self.facts = {"tools": {t: tools[t] for t in TOOLS}, "repetitions": BENCH_REPETITIONS, "samples": []}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.spec.name.replace(' ', '_').replace('/', '_')}.log"

    process = None  # no process between calls: nothing to stop while another engine works

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Nothing: each tool warms up before it times."""

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        batch, input_len = len(prompts), len(prompts[0])
        if batch == 1:
            prefill = self.bench(["-p", input_len, "-n", 0])["avg_ts"]
            decode = self.bench(["-p", 0, "-n", output_len, "-d", input_len])["avg_ts"]
            ttft = input_len / prefill
            return ttft, ttft + (output_len - 1) / decode
        # llama-batched-bench times the prompts together (t_pp) and the batch's decode steps (t_tg)
        result = self.batched(batch, input_len, output_len)
        return result["t_pp"], result["t_pp"] + result["t_tg"] * (output_len - 1) / output_len

    def bench(self, shape: list) -> dict:
        return self.run("llama-bench", [*shape, "-r", BENCH_REPETITIONS, "-o", "jsonl"])[-1]

    def batched(self, batch: int, input_len: int, output_len: int) -> dict:
        context = batch * (input_len + output_len)
        options = ["-c", context, "-npp", input_len, "-ntg", output_len, "-npl", batch, "--output-format", "jsonl"]
        return self.run("llama-batched-bench", options)[-1]

    def run(self, tool: str, options: list) -> list[dict]:
        """The tool's JSON lines on this model with our threads; its peak resident set is kept (the kernel's
        accounting of the process, read when it exits)."""
        command = [self.tools[tool], "-m", self.spec.model, "-t", str(self.threads), *map(str, options)]
        with self.log_path.open("a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log, env={**peer_environment(), **self.spec.env}, text=True
            )
            output = process.stdout.read()
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise NativeToolError(f"{tool} exited with {process.returncode}: see {self.log_path}")
        self.peak_rss_mib = max(self.peak_rss_mib, usage.ru_maxrss / 1024)
        results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        if not results:
            raise NativeToolError(f"{tool} printed no result: see {self.log_path}")
        self.facts["samples"].append({"tool": tool, "options": [str(o) for o in options], "result": results[-1]})
        return results

    def close(self) -> None:
        """Nothing runs between calls."""
