"""Our built engine as a benchmark worker: its ModelRunner (the runner of the target that built it), timed as the
peers are. Its quality is scored by the parent through the target's own `scored` models, as the quality gate does."""

from __future__ import annotations

import time

from pipeline.bench.peers.protocol import arguments, serve


class Ours:
    def __init__(self, engine_dir: str, threads: int, spinning: bool, speculative_config: str | None):
        from pathlib import Path

        from pipeline.targets import load_runner

        runtime = None
        if speculative_config:  # runtime.speculative of the config applies to our engine
            from pipeline.validation import load_config

            runtime = load_config(Path(speculative_config), []).runtime
        self.runner = load_runner(Path(engine_dir), threads, runtime=runtime, thread_spinning=spinning)

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        import torch

        return time_runner(self.runner, [torch.tensor(p) for p in prompts], output_len)


def time_runner(runner, prompts: list, output_len: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for everything) with the ModelRunner interface (ours or ModelRunnerCpp),
    never ending early."""
    started, first = time.perf_counter(), None
    for _ in runner.generate(prompts, max_new_tokens=output_len, end_id=-1, streaming=True):
        first = first or time.perf_counter() - started
    return first, time.perf_counter() - started


def load():
    import onnxruntime

    args = arguments()
    spinning = args.options.get("spinning") == "on"
    engine = Ours(args.model, args.threads, spinning, args.options.get("config"))
    facts = {"onnxruntime": onnxruntime.__version__, "speculative": bool(engine.runner.speculative)}
    return engine, facts


if __name__ == "__main__":
    serve(load)
