"""`ModelRunner.generate`'s inputs and outputs in `ModelRunnerCpp.generate`'s conventions.

Why a module of its own: translating TensorRT-LLM's calling conventions is one concern, apart from driving the
engine. In: the sampling arguments, given one by one or as a tensorrt_llm SamplingConfig, become one `Request` per
prompt. Out: the requests' tokens and log-probabilities become ModelRunnerCpp's tensors (`generate_result`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams, to_words_list, unset_as


@dataclass(frozen=True)
class SamplingArguments:
    """generate's sampling arguments, kept together so that a SamplingConfig can replace them as one."""

    end_id: int | None
    pad_id: int | None
    max_new_tokens: int
    num_beams: int
    temperature: float
    top_k: int
    top_p: float | None
    repetition_penalty: float
    random_seed: int | Sequence[int] | None

    def read(self, sampling_config) -> SamplingArguments:
        """These arguments with the fields we implement of a tensorrt_llm SamplingConfig in their place (its older
        names beam_width and seed too)."""
        get = lambda name, default: getattr(sampling_config, name, default)  # noqa: E731
        return SamplingArguments(
            end_id=get("end_id", self.end_id),
            pad_id=get("pad_id", self.pad_id),
            max_new_tokens=get("max_new_tokens", self.max_new_tokens),
            num_beams=get("num_beams", get("beam_width", self.num_beams)),
            temperature=get("temperature", self.temperature),
            top_k=get("top_k", self.top_k),
            top_p=get("top_p", self.top_p),
            repetition_penalty=get("repetition_penalty", self.repetition_penalty),
            random_seed=get("random_seed", get("seed", self.random_seed)),
        )

    def requests(self, prompts: list[list[int]], end_id: int, stop_words_list, bad_words_list) -> list[Request]:
        """One request per prompt; a setting left unset (None) means "off", and one seed serves every prompt."""
        seeds = (
            list(self.random_seed) if isinstance(self.random_seed, (list, tuple)) else [self.random_seed] * len(prompts)
        )
        stops, bads = to_words_list(stop_words_list, len(prompts)), to_words_list(bad_words_list, len(prompts))
        return [
            Request(
                prompt,
                SamplingParams(
                    self.max_new_tokens,
                    end_id,
                    float(unset_as(self.temperature, 0.0)),
                    int(unset_as(self.top_k, 0)),
                    float(unset_as(self.top_p, 0.0)),
                    float(unset_as(self.repetition_penalty, 1.0)),
                    int(seeds[i] or 0),
                    stops[i],
                    bads[i],
                ),
            )
            for i, prompt in enumerate(prompts)
        ]


def generate_result(
    requests: list[Request],
    max_seq_len: int,
    end_id: int,
    return_dict: bool,
    output_log_probs: bool,
    output_cum_log_probs: bool,
):
    """The requests as they stand, as generate returns them: `output_ids`, or with `return_dict` a dict of it, the
    sequence lengths and the log-probabilities asked for. Filled in numpy and handed to torch without a copy: a
    streaming generate makes this at every step (a third of the time torch's own fill and copy take)."""
    import numpy as np
    import torch

    ids = np.full((len(requests), 1, max_seq_len), end_id, dtype=np.int32)
    for row, r in enumerate(requests):
        ids[row, 0, : len(r.prompt) + len(r.output)] = r.tokens
    output_ids = torch.from_numpy(ids)
    if not return_dict:
        return output_ids
    out = {
        "output_ids": output_ids,
        "sequence_lengths": torch.tensor([[len(r.prompt) + len(r.output)] for r in requests], dtype=torch.int32),
    }
    if output_log_probs:
        out["log_probs"] = padded_log_probs(requests)
    if output_cum_log_probs:
        out["cum_log_probs"] = torch.tensor([[r.cum_log_prob] for r in requests], dtype=torch.float32)
    return out


def padded_log_probs(requests: list[Request]):
    """Each request's log-probabilities [batch, 1, most generated], zero after its own: rows finish unevenly."""
    import torch

    log_probs = torch.zeros((len(requests), 1, max(1, max(len(r.log_probs) for r in requests))), dtype=torch.float32)
    for row, r in enumerate(requests):
        log_probs[row, 0, : len(r.log_probs)] = torch.tensor(r.log_probs, dtype=torch.float32)
    return log_probs
