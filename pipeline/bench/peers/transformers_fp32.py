"""Hugging Face transformers `generate` on the fp32 checkpoint as a benchmark worker: the baseline every user has."""

from __future__ import annotations

import time

from pipeline.bench.peers.protocol import arguments, serve


class Transformers:
    def __init__(self, hf_dir: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """Its first token timed by a one-token generate, as `generate` streams nothing to time it by."""
        torch = self.torch
        ids = torch.tensor(prompts)  # equal lengths: no padding
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            started = time.perf_counter()
            self.model.generate(ids, max_new_tokens=1, **kwargs)
            first = time.perf_counter() - started
            started = time.perf_counter()
            self.model.generate(ids, max_new_tokens=output_len, **kwargs)
        return first, time.perf_counter() - started


def load():
    import transformers

    args = arguments()
    return Transformers(args.model, args.threads), {"transformers": transformers.__version__}


if __name__ == "__main__":
    serve(load)
