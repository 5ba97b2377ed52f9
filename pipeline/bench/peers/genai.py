"""onnxruntime-genai as a benchmark peer: its model builder's CPU model of the checkpoint, driven by its own
generator loop (a static batch), as a worker in the onnxruntime-genai peer's environment."""

from __future__ import annotations

import json
import time

import numpy as np

from pipeline.bench.peers.protocol import arguments, serve


class Genai:
    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model_dir)  # the builder's CPU model, with the benchmark's thread count
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def generator(self, batch: int, length: int, stop: int | None):
        params = self.og.GeneratorParams(self.model)
        options = dict(max_length=length, batch_size=batch, do_sample=False)
        if stop is None:  # fixed length: end of sequence ignored
            options["min_length"] = length
        params.set_search_options(**options)
        return self.og.Generator(self.model, params)

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        ids = np.asarray(prompts, dtype=np.int32)
        started = time.perf_counter()
        generator = self.generator(len(prompts), ids.shape[1] + output_len, None)
        generator.append_tokens(ids)
        generator.generate_next_token()
        first = time.perf_counter() - started
        while not generator.is_done():
            generator.generate_next_token()
        return first, time.perf_counter() - started

    def logits(self, ids: list[int]) -> np.ndarray:
        generator = self.generator(1, len(ids) + 1, None)
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        logits = np.asarray(generator.get_output("logits"), dtype=np.float32)
        if logits.shape[-2] != len(ids):
            raise RuntimeError(f"the model's logits output has {logits.shape[-2]} positions for {len(ids)} tokens")
        return logits.reshape(len(ids), -1)

    def greedy(self, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
        generator = self.generator(1, len(prompt) + max_new_tokens, end_id)
        generator.append_tokens(np.asarray([prompt], dtype=np.int32))
        answer = []
        while not generator.is_done() and len(answer) < max_new_tokens:
            generator.generate_next_token()
            answer.append(int(generator.get_next_tokens()[0]))
        return answer


def load():
    import onnxruntime_genai

    args = arguments()
    return Genai(args.model, args.threads), {"onnxruntime_genai": onnxruntime_genai.__version__}


if __name__ == "__main__":
    serve(load)
