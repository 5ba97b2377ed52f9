"""Triton python model `tensorrt_llm_bls`: preprocessing -> LLM -> postprocessing in code (BLS),
with the ensemble's inputs and outputs.

Why a BLS next to the ensemble: Triton does not pass a client's cancellation into the models of an
ensemble, so a cancelled ensemble request keeps generating to max_tokens. Here each request runs on
its own thread, checks `is_cancelled()` after every LLM response and then sends the LLM model a
`stop` request with the generation's request id (TensorRT-LLM's interface for stopping a request;
Triton 2.51 has no cancel for BLS sub-requests), which retires the row from the running batch. That id is the
client's request id, so a client can send that `stop` itself instead of cancelling, which crashed tritonserver 2.51
(pipeline.triton.client.stream_responses).
Streamed text is detokenized from the accumulated tokens and sent as deltas, so multi-token
characters and leading spaces come out right; text never ends inside a character (its bytes are
dropped when generation ends there).
"""

from __future__ import annotations

import faulthandler
import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

faulthandler.enable()  # a crash dumps every thread's stack to stderr: tritonserver's log, which `serve` quotes

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# client input -> preprocessing input
TO_PREPROCESSING = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
}
# preprocessing output -> LLM input
FROM_PREPROCESSING = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "BAD_WORDS_IDS": "bad_words_list",
    "STOP_WORDS_IDS": "stop_words_list",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
}
# client input -> LLM input, passed through when present
TO_LLM = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "length_penalty": "len_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_length": "min_length",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "random_seed": "random_seed",
    "return_log_probs": "return_log_probs",
    "beam_width": "beam_width",
    "exclude_input_in_output": "exclude_input_in_output",
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
    "lora_task_id": "lora_task_id",
    "lora_weights": "lora_weights",
    "lora_config": "lora_config",
}
LLM_OUTPUTS = ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "batch_index", "sequence_index"]


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm_bls: {message}"))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.llm = params.get("tensorrt_llm_model_name", "tensorrt_llm")
        self.preprocessing = params.get("preprocessing_model_name", "preprocessing")
        self.postprocessing = params.get("postprocessing_model_name", "postprocessing")
        # inputs the LLM model declares under another name (TensorRT-LLM 1.2's min_tokens and seed)
        renamed = json.loads(params.get("llm_input_names") or "{}")
        self.to_llm = {client: renamed.get(name, name) for client, name in TO_LLM.items()}

    def execute(self, requests):
        for request in requests:  # one thread per request: a long generation must not hold up the others
            # inputs are copied here: the request's tensors are freed once execute returns, and a thread reading
            # them later crashed the stub (segfault in libpython under the soak, scripts/soak.py)
            inputs = {t.name(): t.as_numpy().copy() for t in request.inputs()}
            sender = request.get_response_sender()
            request_id = request.request_id() or f"bls-{uuid.uuid4().hex}"
            threading.Thread(target=self._serve, args=(inputs, sender, request_id), daemon=True).start()
        return None

    def _serve(self, inputs: dict, sender, request_id: str) -> None:
        try:
            self._generate(inputs, sender, request_id)
        except Exception as exc:  # report to this client only
            sender.send(_error(str(exc)), flags=FINAL)

    def _generate(self, inputs: dict, sender, request_id: str) -> None:
        stream = bool(inputs["stream"].reshape(-1)[0]) if "stream" in inputs else False
        if "beam_width" in inputs and int(inputs["beam_width"].reshape(-1)[0]) > 1 and stream:
            raise ValueError("streaming with beam_width > 1 is not supported")
        pre = pb_utils.InferenceRequest(
            model_name=self.preprocessing,
            requested_output_names=list(FROM_PREPROCESSING),
            inputs=[
                pb_utils.Tensor(TO_PREPROCESSING[name], value)
                for name, value in inputs.items()
                if name in TO_PREPROCESSING
            ],
        ).exec()
        if pre.has_error():
            raise RuntimeError(pre.error().message())
        llm_inputs = [pb_utils.Tensor(FROM_PREPROCESSING[t.name()], t.as_numpy()) for t in pre.output_tensors()]
        llm_inputs += [pb_utils.Tensor(self.to_llm[name], value) for name, value in inputs.items() if name in TO_LLM]
        llm_inputs.append(pb_utils.Tensor("streaming", np.array([[stream]], dtype=bool)))
        responses = pb_utils.InferenceRequest(
            model_name=self.llm, requested_output_names=LLM_OUTPUTS, inputs=llm_inputs, request_id=request_id
        ).exec(decoupled=True)

        tokens: dict[int, list[int]] = {}  # batch index -> tokens so far (streaming) or the final tokens
        texts: dict[int, str] = {}
        log_probs: dict[int, list[float]] = {}
        last = {}
        for response in responses:
            if sender.is_cancelled():
                self._stop(request_id)
                for _ in responses:  # the stopped generation ends with one empty final response
                    pass
                break  # the final flag below completes the request: without it Triton waits for it at shutdown
            if response.has_error():
                raise RuntimeError(response.error().message())
            outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if not outputs:
                continue  # the LLM's flags-only final response
            row = int(outputs["batch_index"].reshape(-1)[0])
            new = outputs["output_ids"].reshape(-1)[: int(outputs["sequence_length"].reshape(-1)[0])].tolist()
            tokens[row] = tokens.get(row, []) + new if stream else new
            log_probs[row] = (
                log_probs.get(row, []) + outputs["output_log_probs"].reshape(-1).tolist()
                if stream
                else outputs["output_log_probs"].reshape(-1).tolist()
            )
            last[row] = outputs
            if stream:  # one response per token, also for an LLM response that carried several
                new_log_probs = outputs["output_log_probs"].reshape(-1).tolist()
                first = len(tokens[row]) - len(new)
                for i in range(max(1, len(new))):  # a response without tokens is still answered
                    text = self._detokenize(tokens[row][: first + i + 1])
                    delta, texts[row] = text[len(texts.get(row, "")) :], text
                    sender.send(self._response(delta, outputs, new_log_probs[i : i + 1]))
        if not stream and not sender.is_cancelled():
            for row in sorted(tokens):
                sender.send(self._response(self._detokenize(tokens[row]), last[row], log_probs[row]))
        sender.send(flags=FINAL)

    def _stop(self, request_id: str) -> None:
        stop = pb_utils.InferenceRequest(
            model_name=self.llm,
            requested_output_names=[],
            request_id=request_id,
            inputs=[
                pb_utils.Tensor("stop", np.array([[True]])),
                pb_utils.Tensor("input_lengths", np.array([[0]], dtype=np.int32)),
                pb_utils.Tensor("request_output_len", np.array([[0]], dtype=np.int32)),
            ],
        )
        for _ in stop.exec(decoupled=True):  # the LLM model answers with one empty final response
            pass

    def _detokenize(self, tokens: list[int]) -> str:
        response = pb_utils.InferenceRequest(
            model_name=self.postprocessing,
            requested_output_names=["OUTPUT"],
            inputs=[
                pb_utils.Tensor("TOKENS_BATCH", np.array([[tokens]], dtype=np.int32).reshape(1, 1, -1)),
                pb_utils.Tensor("SEQUENCE_LENGTH", np.array([[len(tokens)]], dtype=np.int32)),
            ],
        ).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        text = pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy().reshape(-1)[0].decode("utf-8")
        # tokens ending inside a UTF-8 character (a length cut in an emoji) decode to a trailing U+FFFD (the test
        # the LLM model's streaming holds such tokens back by); their bytes are dropped instead, and a delta taken
        # against this text still sends the character once a later token completes it
        return text.rstrip("\ufffd")

    @staticmethod
    def _response(text: str, outputs: dict, log_probs: list[float]):
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
                pb_utils.Tensor("cum_log_probs", outputs["cum_log_probs"].reshape(1, -1).astype(np.float32)),
                pb_utils.Tensor("output_log_probs", np.asarray(log_probs, dtype=np.float32).reshape(1, 1, -1)),
                pb_utils.Tensor("batch_index", outputs["batch_index"].reshape(1, 1).astype(np.int32)),
                pb_utils.Tensor("sequence_index", outputs["sequence_index"].reshape(1, 1).astype(np.int32)),
            ]
        )
