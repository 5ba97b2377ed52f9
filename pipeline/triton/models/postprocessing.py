"""Triton python model: token ids -> text. Same inputs and outputs as tensorrtllm_backend's
`postprocessing` model (TOKENS_BATCH [batch, beams, len], SEQUENCE_LENGTH -> OUTPUT).

Streaming sends each chunk of tokens separately, and decoding a chunk on its own drops the leading
space of SentencePiece tokens ("▁Paris" decodes to "Paris"). Each chunk is therefore decoded after
a fixed anchor token and the anchor's text is cut off, so concatenated chunks equal the decoded
whole. (The LLM model holds back tokens that end inside a UTF-8 character.)

Text is the tokens' own, never "cleaned up": transformers' `clean_up_tokenization_spaces` (on in
SmolLM2's tokenizer) deletes the space before a comma or a period, which changes what the model
wrote (inside a JSON string too) and, once a later token brings the comma, shortens text already
streamed, so a delta cut at the old length lost the comma.
"""

from __future__ import annotations

import faulthandler
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

faulthandler.enable()  # a crash dumps every thread's stack to stderr: tritonserver's log, which `serve` quotes


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"])
        self.skip_special_tokens = params.get("skip_special_tokens", "true").lower() == "true"
        self.anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
        self.anchor_text = self.tokenizer.decode(self.anchor)

    def decode(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        options = {"skip_special_tokens": self.skip_special_tokens, "clean_up_tokenization_spaces": False}
        text = self.tokenizer.decode(self.anchor + tokens, **options)
        return (
            text[len(self.anchor_text) :]
            if text.startswith(self.anchor_text)
            else self.tokenizer.decode(tokens, **options)
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            texts = [
                self.decode(beam[: int(length)].tolist())
                for batch, batch_lengths in zip(tokens, lengths)
                for beam, length in zip(batch, batch_lengths)
            ]
            output = np.array([t.encode("utf-8") for t in texts], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)]))
        return responses
