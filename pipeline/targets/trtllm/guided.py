"""Guided decoding (structured outputs) on TensorRT-LLM's C++ `tensorrtllm` backend: the parameters that turn it
on and the xgrammar tokenizer info file that backend loads, per release.

What a release's backend takes is tabulated from its sources (upstream/tensorrtllm_backend.json, by
scripts/dev/tabulate_trtllm_backend.py): `guide_types` (what a request may name in `guided_decoding_guide_type`),
`guided_decoding_backends` (the values its `guided_decoding_backend` parameter accepts) and `tokenizer_info` (the
keys it reads, without a fallback, from the JSON file `xgrammar_tokenizer_info_path` names, with their C++ types).
The C++ backend ignores `tokenizer_dir` for guided decoding and needs that file instead; 0.18 has none of this.

The file is ours: xgrammar's tokenizer description as TensorRT-LLM's own generator writes it (the vocabulary in
token id order, the fast tokenizer's serialized JSON, the end-of-sequence id as the stop token), made from the
engine directory's tokenizer files with `transformers`, so no TensorRT-LLM install is needed to make it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import BuildStepError
from pipeline.targets.trtllm.triton_cpp_backend import backend_facts

GUIDED_DECODING_BACKEND = "xgrammar"
BACKEND_PARAMETER = "guided_decoding_backend"
INFO_PATH_PARAMETER = "xgrammar_tokenizer_info_path"
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"  # in the engine directory, beside the tokenizer it describes
REBUILD = "rebuild the engine (`trtllm-pipeline build` re-runs the engine stage, which writes it)"


def takes_guided_decoding(version: str) -> bool:
    """Whether the release's C++ backend can decode guided (0.19 on): it accepts a backend and reads the info file."""
    facts = backend_facts(version)
    return bool(facts["guided_decoding_backends"]) and bool(facts["tokenizer_info"])


def xgrammar_tokenizer_info(tokenizer_dir: Path) -> dict:
    """The tokenizer info of the HF tokenizer in `tokenizer_dir`: {"encoded_vocab": token strings indexed by id,
    "tokenizer_str": the fast tokenizer's JSON, "stop_token_ids": [its end-of-sequence id]}."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise BuildStepError(
            f"{tokenizer_dir}: guided decoding needs a fast tokenizer (tokenizer.json), since the tensorrtllm backend "
            f"reads its serialized form; this one is {type(tokenizer).__name__}. Add the model's tokenizer.json"
        )
    if tokenizer.eos_token_id is None:
        raise BuildStepError(
            f"{tokenizer_dir}: the tokenizer has no eos_token, which guided decoding stops on; set eos_token in "
            "tokenizer_config.json"
        )
    by_id = sorted((index, token) for token, index in tokenizer.get_vocab().items())
    gaps = [index for position, (index, _) in enumerate(by_id) if index != position][:3]
    if gaps:  # the backend indexes the list by token id
        raise BuildStepError(
            f"{tokenizer_dir}: token ids are not 0..{len(by_id) - 1} without gaps (first out of place: {gaps}), so "
            "the vocabulary cannot be listed by id for guided decoding; fix the tokenizer's added tokens"
        )
    return {
        "encoded_vocab": [token for _, token in by_id],
        "tokenizer_str": tokenizer.backend_tokenizer.to_str(),
        "stop_token_ids": [tokenizer.eos_token_id],
    }


def write_tokenizer_info(tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write TOKENIZER_INFO_FILE for the tokenizer in `tokenizer_dir` into `out_dir`."""
    path = out_dir / TOKENIZER_INFO_FILE
    path.write_text(json.dumps(xgrammar_tokenizer_info(tokenizer_dir), ensure_ascii=False))
    return path


def _holds(value, cpp_type: str) -> bool:
    """Whether a JSON value reads as `cpp_type` in nlohmann::json's get<T>: a string, an integer or a vector."""
    if cpp_type.startswith("std::vector<") and cpp_type.endswith(">"):
        return isinstance(value, list) and all(_holds(item, cpp_type[len("std::vector<") : -1]) for item in value)
    if cpp_type == "std::string":
        return isinstance(value, str)
    if cpp_type.endswith(("TokenIdType", "int32_t", "int64_t", "SizeType32")):
        return isinstance(value, int) and not isinstance(value, bool)
    raise ValueError(f"no JSON check for the C++ type {cpp_type}: add one to _holds")


def tokenizer_info_problems(path: Path, version: str) -> list[str]:
    """What would stop the release's backend from loading the tokenizer info file at `path`: it must exist and hold
    every key the backend reads, each of the type the backend reads it as (an empty list when it would load)."""
    if not path.is_file():
        return [f"{path} does not exist: the tensorrtllm backend fails to load without it; {REBUILD}"]
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return [f"{path} is not JSON ({error}); {REBUILD}"]
    if not isinstance(info, dict):
        return [f"{path} holds a {type(info).__name__}, not a JSON object; {REBUILD}"]
    problems = []
    for key, cpp_type in backend_facts(version)["tokenizer_info"].items():
        if key not in info:
            problems.append(f"{path} lacks {key!r}, which TensorRT-LLM {version}'s backend reads; {REBUILD}")
        elif not _holds(info[key], cpp_type):
            problems.append(f"{path}: {key!r} is not a {cpp_type}, as the backend reads it; {REBUILD}")
    return problems


def config_problems(parameters: dict[str, str], version: str) -> list[str]:
    """What would stop the release's C++ backend from loading a `tensorrt_llm` model with these (string) parameters
    for guided decoding: a backend it does not accept, or an info file it cannot open or read. Guided decoding left
    off (either value empty or an unfilled `${...}` placeholder, the backend's own "off") is no problem."""
    backend, path = parameters.get(BACKEND_PARAMETER, ""), parameters.get(INFO_PATH_PARAMETER, "")
    if not takes_guided_decoding(version) or not backend or not path or "${" in backend + path:
        return []
    accepted = backend_facts(version)["guided_decoding_backends"]
    if backend not in accepted:
        return [
            f"parameter {BACKEND_PARAMETER!r} is {backend!r}: TensorRT-LLM {version}'s tensorrtllm backend accepts "
            f"{accepted} and fails to load with anything else; set {GUIDED_DECODING_BACKEND!r}"
        ]
    if not Path(path).is_absolute():
        return [
            f"parameter {INFO_PATH_PARAMETER!r} is {path!r}: the backend opens it as given, from tritonserver's "
            "working directory; give an absolute path"
        ]
    return tokenizer_info_problems(Path(path), version)


def engine_parameters(version: str, engine_dir: Path) -> dict[str, object]:
    """The `tensorrt_llm` model's parameters turning guided decoding on for the engine in `engine_dir` (none for a
    release without it), checked as `config_problems` checks a written repository."""
    if not takes_guided_decoding(version):
        return {}
    parameters = {BACKEND_PARAMETER: GUIDED_DECODING_BACKEND, INFO_PATH_PARAMETER: engine_dir / TOKENIZER_INFO_FILE}
    problems = config_problems({key: str(value) for key, value in parameters.items()}, version)
    if problems:
        raise BuildStepError("guided decoding cannot be turned on:\n  " + "\n  ".join(problems))
    return parameters
