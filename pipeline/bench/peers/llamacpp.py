"""llama.cpp as a benchmark peer: a GGUF model through llama-cpp-python's low-level bindings (the library that
llama-batched-bench and llama-server drive), run as a worker in the llama.cpp peer's environment.

Batches go as llama.cpp's own batched tools send them: every prompt of the batch in one `llama_decode` (split into
micro-batches by the library), then one token per sequence per step, each sequence in its own KV cache slot.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from pipeline.bench.peers.protocol import arguments, serve

CONTEXT_STEP = 256  # context sizes are rounded up to this, so that nearby requests share one context


class LlamaCpp:
    def __init__(self, model_path: str, threads: int):
        import llama_cpp as llama

        self.llama, self.threads = llama, threads
        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(model_path.encode(), llama.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.ctx, self.shape, self.batch = None, None, None

    def context(self, sequences: int, tokens_per_sequence: int):
        """A context with a KV cache slot of `tokens_per_sequence` for each of `sequences` (library defaults
        otherwise: flash attention auto, micro-batches of 512); reused while the shape fits."""
        llama = self.llama
        per_sequence = -(-tokens_per_sequence // CONTEXT_STEP) * CONTEXT_STEP
        if self.shape != (sequences, per_sequence):
            self.close()
            params = llama.llama_context_default_params()
            params.n_ctx = params.n_batch = sequences * per_sequence
            params.n_seq_max = sequences
            params.kv_unified = False
            params.n_threads = params.n_threads_batch = self.threads
            self.ctx = llama.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {sequences} x {per_sequence} tokens")
            self.batch = llama.llama_batch_init(params.n_batch, 0, 1)
            self.shape = (sequences, per_sequence)
        self.llama.llama_memory_clear(self.llama.llama_get_memory(self.ctx), True)
        return self.ctx

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, position, sequence, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, wants
        batch.n_tokens = len(entries)
        status = self.llama.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def row(self, output: int) -> np.ndarray:
        pointer = self.llama.llama_get_logits_ith(self.ctx, output)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        self.context(len(prompts), len(prompts[0]) + output_len)
        started = time.perf_counter()
        entries = [
            (token, position, seq, position == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for position, token in enumerate(prompt)
        ]
        self.decode(entries)
        last = [i for i, entry in enumerate(entries) if entry[3]]
        tokens = [int(self.row(i).argmax()) for i in last]
        first = time.perf_counter() - started
        for step in range(1, output_len):
            self.decode([(token, len(prompts[seq]) + step - 1, seq, True) for seq, token in enumerate(tokens)])
            tokens = [int(self.row(seq).argmax()) for seq in range(len(prompts))]
        return first, time.perf_counter() - started

    def logits(self, ids: list[int]) -> np.ndarray:
        self.context(1, len(ids))
        self.decode([(token, position, 0, True) for position, token in enumerate(ids)])
        pointer = ctypes.cast(self.llama.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(pointer, shape=(len(ids), self.n_vocab)).copy()

    def greedy(self, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
        self.context(1, len(prompt) + max_new_tokens)
        self.decode([(token, position, 0, position == len(prompt) - 1) for position, token in enumerate(prompt)])
        answer = [int(self.row(len(prompt) - 1).argmax())]
        while answer[-1] != end_id and len(answer) < max_new_tokens:
            self.decode([(answer[-1], len(prompt) + len(answer) - 1, 0, True)])
            answer.append(int(self.row(0).argmax()))
        return answer

    def close(self) -> None:
        if self.ctx:
            self.llama.llama_batch_free(self.batch)
            self.llama.llama_free(self.ctx)
            self.ctx = None


def load():
    import llama_cpp

    args = arguments()
    engine = LlamaCpp(args.model, args.threads)
    return engine, {"llama_cpp_python": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode()}


if __name__ == "__main__":
    serve(load)
