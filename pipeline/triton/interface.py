"""The tensors of each model in the repository, named as in TensorRT-LLM's `inflight_batcher_llm`
templates (tensorrtllm_backend v0.19.0), so clients of a GPU deployment work against a CPU one.

Each entry is (name, data type, dims, optional). Configs are built as `ModelConfig` protobufs from
these tables, never by string templating, so every generated `config.pbtxt` is valid by construction.
"""

from __future__ import annotations

Tensor = tuple[str, str, list[int], bool]

SCALAR = [1]

# Ensemble and BLS: what clients send and receive.
CLIENT_INPUTS: list[Tensor] = [
    ("text_input", "TYPE_STRING", SCALAR, False),
    ("max_tokens", "TYPE_INT32", SCALAR, False),
    ("bad_words", "TYPE_STRING", [-1], True),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("exclude_input_in_output", "TYPE_BOOL", SCALAR, True),
    ("end_id", "TYPE_INT32", SCALAR, True),
    ("pad_id", "TYPE_INT32", SCALAR, True),
    ("top_k", "TYPE_INT32", SCALAR, True),
    ("top_p", "TYPE_FP32", SCALAR, True),
    ("temperature", "TYPE_FP32", SCALAR, True),
    ("length_penalty", "TYPE_FP32", SCALAR, True),
    ("repetition_penalty", "TYPE_FP32", SCALAR, True),
    ("min_length", "TYPE_INT32", SCALAR, True),
    ("presence_penalty", "TYPE_FP32", SCALAR, True),
    ("frequency_penalty", "TYPE_FP32", SCALAR, True),
    ("random_seed", "TYPE_UINT64", SCALAR, True),
    ("return_log_probs", "TYPE_BOOL", SCALAR, True),
    ("beam_width", "TYPE_INT32", SCALAR, True),
    ("stream", "TYPE_BOOL", SCALAR, True),
]
# Client inputs the LLM model takes under the same name where it declares them: guided decoding (tensorrtllm_backend
# 0.19 on, and our CPU model), LoRA (the task id: both; the weights and their config, TensorRT-LLM's LoRA cache only).
# The ensemble and BLS of a repository whose LLM model lacks one leave it out.
GUIDED_INPUTS: list[Tensor] = [
    ("guided_decoding_guide_type", "TYPE_STRING", SCALAR, True),
    ("guided_decoding_guide", "TYPE_STRING", SCALAR, True),
]
LORA_TASK_ID: Tensor = ("lora_task_id", "TYPE_UINT64", SCALAR, True)
FEATURE_INPUTS: list[Tensor] = [
    *GUIDED_INPUTS,
    LORA_TASK_ID,
    ("lora_weights", "TYPE_FP16", [-1, -1], True),
    ("lora_config", "TYPE_INT32", [-1, 3], True),
]
LLM_FEATURE_INPUTS = tuple(name for name, *_ in FEATURE_INPUTS)
CLIENT_INPUTS += FEATURE_INPUTS
CLIENT_OUTPUTS: list[Tensor] = [
    ("text_output", "TYPE_STRING", [-1], False),
    ("cum_log_probs", "TYPE_FP32", [-1], False),
    ("output_log_probs", "TYPE_FP32", [-1, -1], False),
    ("batch_index", "TYPE_INT32", SCALAR, False),
    ("sequence_index", "TYPE_INT32", SCALAR, False),
]

PREPROCESSING_INPUTS: list[Tensor] = [
    ("QUERY", "TYPE_STRING", SCALAR, False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", SCALAR, False),
    ("BAD_WORDS_DICT", "TYPE_STRING", [-1], True),
    ("STOP_WORDS_DICT", "TYPE_STRING", [-1], True),
    ("END_ID", "TYPE_INT32", SCALAR, True),
    ("PAD_ID", "TYPE_INT32", SCALAR, True),
]
PREPROCESSING_OUTPUTS: list[Tensor] = [
    ("INPUT_ID", "TYPE_INT32", [-1], False),
    ("REQUEST_INPUT_LEN", "TYPE_INT32", SCALAR, False),
    ("BAD_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    ("STOP_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", [-1], False),
    ("OUT_END_ID", "TYPE_INT32", SCALAR, False),
    ("OUT_PAD_ID", "TYPE_INT32", SCALAR, False),
]

# The LLM model the ensemble and BLS call (the `tensorrt_llm` template's names): what a target's LLM model declares.
LLM_INPUTS: list[Tensor] = [
    ("input_ids", "TYPE_INT32", [-1], True),  # optional, as in the template: a `stop` request carries none
    ("input_lengths", "TYPE_INT32", SCALAR, False),
    ("request_output_len", "TYPE_INT32", SCALAR, False),
    ("end_id", "TYPE_INT32", SCALAR, True),
    ("pad_id", "TYPE_INT32", SCALAR, True),
    ("stop_words_list", "TYPE_INT32", [2, -1], True),
    ("bad_words_list", "TYPE_INT32", [2, -1], True),
    ("beam_width", "TYPE_INT32", SCALAR, True),
    ("temperature", "TYPE_FP32", SCALAR, True),
    ("runtime_top_k", "TYPE_INT32", SCALAR, True),
    ("runtime_top_p", "TYPE_FP32", SCALAR, True),
    ("len_penalty", "TYPE_FP32", SCALAR, True),
    ("repetition_penalty", "TYPE_FP32", SCALAR, True),
    ("min_length", "TYPE_INT32", SCALAR, True),
    ("presence_penalty", "TYPE_FP32", SCALAR, True),
    ("frequency_penalty", "TYPE_FP32", SCALAR, True),
    ("random_seed", "TYPE_UINT64", SCALAR, True),
    ("return_log_probs", "TYPE_BOOL", SCALAR, True),
    ("exclude_input_in_output", "TYPE_BOOL", SCALAR, True),
    ("streaming", "TYPE_BOOL", SCALAR, True),
    ("stop", "TYPE_BOOL", SCALAR, True),  # true: stop the running request with this request's id
    *GUIDED_INPUTS,
]
# An LLM model of an engine built with LoRA: the task id selects a row's adapter among those registered. No input
# loads an adapter: Triton's ports carry no authentication (adapters come from the build or `serve`'s registry).
LORA_LLM_INPUTS: list[Tensor] = [LORA_TASK_ID]
LLM_OUTPUTS: list[Tensor] = [
    ("output_ids", "TYPE_INT32", [-1, -1], False),
    ("sequence_length", "TYPE_INT32", [-1], False),
    ("cum_log_probs", "TYPE_FP32", [-1], False),
    ("output_log_probs", "TYPE_FP32", [-1, -1], False),
    ("batch_index", "TYPE_INT32", SCALAR, False),
    ("sequence_index", "TYPE_INT32", SCALAR, False),
]

# An output our LLM models add to the template's (never sent unless a request asks for it): the text each token of
# the response adds (one string per token of `output_ids`), decoded where the tokens are made, so a client of the LLM
# model itself needs no postprocessing model.
LLM_TEXT_OUTPUT: Tensor = ("text_output", "TYPE_STRING", [-1], False)

POSTPROCESSING_INPUTS: list[Tensor] = [
    ("TOKENS_BATCH", "TYPE_INT32", [-1, -1], False),
    ("SEQUENCE_LENGTH", "TYPE_INT32", [-1], False),
]
POSTPROCESSING_OUTPUTS: list[Tensor] = [("OUTPUT", "TYPE_STRING", [-1], False)]

# Ensemble wiring, as in the v0.19.0 template:
# (model role, {model input: ensemble tensor}, {model output: ensemble tensor}).
ENSEMBLE_STEPS = [
    (
        "preprocessing",
        {
            "QUERY": "text_input",
            "REQUEST_OUTPUT_LEN": "max_tokens",
            "BAD_WORDS_DICT": "bad_words",
            "STOP_WORDS_DICT": "stop_words",
            "END_ID": "end_id",
            "PAD_ID": "pad_id",
        },
        {
            "INPUT_ID": "_INPUT_ID",
            "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
            "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
            "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
            "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
            "OUT_END_ID": "_PREPROCESSOR_END_ID",
            "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
        },
    ),
    (
        "llm",
        {
            "input_ids": "_INPUT_ID",
            "input_lengths": "_REQUEST_INPUT_LEN",
            "request_output_len": "_REQUEST_OUTPUT_LEN",
            "exclude_input_in_output": "exclude_input_in_output",
            "end_id": "_PREPROCESSOR_END_ID",
            "pad_id": "_PREPROCESSOR_PAD_ID",
            "runtime_top_k": "top_k",
            "runtime_top_p": "top_p",
            "temperature": "temperature",
            "len_penalty": "length_penalty",
            "repetition_penalty": "repetition_penalty",
            "min_length": "min_length",
            "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty",
            "random_seed": "random_seed",
            "return_log_probs": "return_log_probs",
            "beam_width": "beam_width",
            "streaming": "stream",
            "stop_words_list": "_STOP_WORDS_IDS",
            "bad_words_list": "_BAD_WORDS_IDS",
            **{name: name for name in LLM_FEATURE_INPUTS},
        },
        {
            "output_ids": "_TOKENS_BATCH",
            "sequence_length": "_SEQUENCE_LENGTH",
            "cum_log_probs": "cum_log_probs",
            "output_log_probs": "output_log_probs",
            "batch_index": "batch_index",
            "sequence_index": "sequence_index",
        },
    ),
    (
        "postprocessing",
        {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        {"OUTPUT": "text_output"},
    ),
]

# Inputs of TensorRT-LLM's ensemble/BLS (0.18-1.2) that this pipeline does not wire, and why; no config field can
# ask for them, so a request sending one is refused by Triton as an unknown input.
UNWIRED_CLIENT_INPUTS = {
    "decoder_text_input": "encoder-decoder models are not built",
    "embedding_bias_words": "no logits bias (needs a vocabulary-sized tensor per request)",
    "embedding_bias_weights": "no logits bias",
    "num_return_sequences": "one sequence per request (beam_width for beams)",
    "prompt_embedding_table": "no prompt tuning or multimodal embeddings",
    "prompt_table_extra_id": "no prompt tuning",
    "prompt_vocab_size": "no prompt tuning",
    "return_context_logits": "logits are not returned (engines are built without gather_*_logits)",
    "return_generation_logits": "logits are not returned",
    "return_kv_cache_reuse_stats": "per-request statistics are not returned (Triton's /metrics has the totals)",
    "return_perf_metrics": "per-request statistics are not returned",
    "return_num_input_tokens": "per-request statistics are not returned",
    "return_num_output_tokens": "per-request statistics are not returned",
}
