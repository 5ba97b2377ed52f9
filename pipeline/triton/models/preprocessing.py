"""Triton python model: prompt text -> token ids; stop/bad words -> TensorRT-LLM's [2, len] word lists.

Same inputs and outputs as the `preprocessing` model of tensorrtllm_backend's inflight_batcher_llm,
so it serves both targets. Every element of STOP_WORDS_DICT / BAD_WORDS_DICT is one word (it may
span several tokens), encoded without special tokens.
"""

from __future__ import annotations

import faulthandler
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

faulthandler.enable()  # a crash dumps every thread's stack to stderr: tritonserver's log, which `serve` quotes


def _strings(request, name: str) -> list[list[str]] | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    array = array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)
    return [[v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row] for row in array]


def _scalar_rows(request, name: str, rows: int, default: int) -> np.ndarray:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return np.full((rows, 1), default, dtype=np.int32)
    return tensor.as_numpy().astype(np.int32).reshape(rows, 1)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"])
        self.add_special_tokens = params.get("add_special_tokens", "false").lower() == "true"
        eos = self.tokenizer.eos_token_id
        self.end_id = int(params.get("end_id") or (eos if eos is not None else 0))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(params.get("pad_id") or (pad if pad is not None else self.end_id))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._preprocess(request)))
            except Exception as exc:  # one bad request must not fail the others batched with it
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {exc}")))
        return responses

    def _preprocess(self, request) -> list:
        queries = _strings(request, "QUERY")
        ids = [self.tokenizer.encode(row[0], add_special_tokens=self.add_special_tokens) for row in queries]
        rows = len(ids)
        end_id = _scalar_rows(request, "END_ID", rows, self.end_id)
        pad_id = _scalar_rows(request, "PAD_ID", rows, self.pad_id)
        width = max(1, max(len(i) for i in ids))
        input_ids = np.array([i + [int(pad_id[r, 0])] * (width - len(i)) for r, i in enumerate(ids)], dtype=np.int32)
        output_len = (
            pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN")
            .as_numpy()
            .astype(np.int32)
            .reshape(rows, 1)
        )
        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(i)] for i in ids], dtype=np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", self._word_lists(_strings(request, "BAD_WORDS_DICT"), rows)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._word_lists(_strings(request, "STOP_WORDS_DICT"), rows)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len),
            pb_utils.Tensor("OUT_END_ID", end_id),
            pb_utils.Tensor("OUT_PAD_ID", pad_id),
        ]

    def _word_lists(self, words: list[list[str]] | None, rows: int) -> np.ndarray:
        """[rows, 2, n]: concatenated token ids, then cumulative end offsets padded with -1."""
        if words is None:
            return np.zeros((rows, 2, 0), dtype=np.int32)
        flat, offsets = [], []
        for row in words:
            encoded = [ids for ids in (self.tokenizer.encode(w, add_special_tokens=False) for w in row if w) if ids]
            flat.append([t for ids in encoded for t in ids])
            offsets.append(list(np.cumsum([len(ids) for ids in encoded])))
        width = max(1, max(len(f) for f in flat))
        return np.array(
            [[f + [0] * (width - len(f)), o + [-1] * (width - len(o))] for f, o in zip(flat, offsets)], dtype=np.int32
        )
