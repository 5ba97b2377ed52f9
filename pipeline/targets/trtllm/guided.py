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

The backend hands `tokenizer_str` to the xgrammar its release depends on (0.19 and 0.20: 0.1.16, 0.21: one of 0.1.16 to
0.1.21, 1.0: 0.1.21, 1.1 and 1.2: 0.1.25), whose DetectMetadataFromHF takes the vocabulary type from the tokenizer
JSON's `decoder` and add_prefix_space from its `normalizer` / `pre_tokenizer` (upstream/trtllm_pytorch_features.json:
`xgrammar`, read from each version's source; the version per release in `releases` and, for 0.19-0.21,
`cpp_backend_xgrammar`). Every one of those versions reads a tokenizer alike.
`tokenizer_info_problems` applies those rules: the string must be a JSON object, and a byte-level tokenizer must be
detected as such, or every grammar is matched against the wrong token text.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import upstream
from pipeline.errors import BuildStepError
from pipeline.targets.trtllm.triton_cpp_backend import backend_facts

GUIDED_DECODING_BACKEND = "xgrammar"
BACKEND_PARAMETER = "guided_decoding_backend"
INFO_PATH_PARAMETER = "xgrammar_tokenizer_info_path"
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"  # in the engine directory, beside the tokenizer it describes
REBUILD = "rebuild the engine (`trtllm-pipeline build` re-runs the engine stage, which writes it)"
BYTE_LEVEL = "ByteLevel"  # the tokenizers library's type name of a byte-level pre-tokenizer and decoder


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


def xgrammar_facts(version: str) -> dict | None:
    """What the xgrammar TensorRT-LLM `version` depends on reads of a tokenizer, with that xgrammar's `version` (a
    range where the table bounds the release's xgrammar, all of whose versions read alike); None for a release the
    table does not hold."""
    table = upstream.facts("trtllm_pytorch_features")  # per release its xgrammar, per xgrammar what it reads
    release = table["releases"].get(version) or table["cpp_backend_xgrammar"]["releases"].get(version)
    if release is None:
        return None
    named = release["xgrammar"]["version"]
    versions = [named] if named else release["xgrammar"]["versions"]  # a range the tabulator found to read alike
    reads = {key: value for key, value in table["xgrammar"][versions[0]].items() if key != "source"}
    return reads | {"version": named or f"{versions[0]} to {versions[-1]}"}


def _listed(node: dict, sequence: dict | None) -> list:
    """The items of a `Sequence` node (its list field), or the node itself."""
    if sequence and node.get("type") == sequence["type"]:
        items = node.get(sequence["items"])
        return items if isinstance(items, list) else []
    return [node]


def detected_metadata(tokenizer: dict, rules: dict) -> dict:
    """{"vocab_type": a VocabType name, "add_prefix_space": bool}, as xgrammar's DetectMetadataFromHF finds them in
    a Hugging Face tokenizer JSON by `rules` (the version's tabulated `detect_from_hf`)."""
    vocab = rules["vocab_type"]
    vocab_type, decoder = vocab["otherwise"], tokenizer.get(vocab["field"])
    for item in _listed(decoder, vocab["sequence"]) if isinstance(decoder, dict) else []:
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(kind, str) or kind in vocab["by_type"]:  # an item without a type: xgrammar gives up
            vocab_type = vocab["by_type"].get(kind, vocab["otherwise"])
            break
    prefix = False
    for rule in rules["add_prefix_space"]:
        node = tokenizer.get(rule["field"])
        items = _listed(node, rule.get("sequence")) if isinstance(node, dict) else []
        prefix = prefix or any(
            isinstance(i, dict) and i.get("type") == rule["type"] and i.get(rule["key"]) in rule["values"]
            for i in items
        )
    return {"vocab_type": vocab_type, "add_prefix_space": prefix}


def _byte_level(tokenizer: dict) -> bool:
    """Whether the tokenizer splits text into byte-level tokens (a ByteLevel pre-tokenizer, alone or in a Sequence)."""
    node = tokenizer.get("pre_tokenizer")
    items = _listed(node, {"type": "Sequence", "items": "pretokenizers"}) if isinstance(node, dict) else []
    return any(isinstance(i, dict) and i.get("type") == BYTE_LEVEL for i in items)


def xgrammar_problems(path: Path, tokenizer_str, version: str) -> list[str]:
    """What the xgrammar of TensorRT-LLM `version` would get wrong reading `tokenizer_str` (none for a release not
    tabulated): a string that is no JSON object fails DetectMetadataFromHF; a byte-level tokenizer whose decoder
    makes it detect another vocabulary type has its tokens decoded as the wrong text."""
    xgrammar = xgrammar_facts(version)
    if xgrammar is None:
        return []
    named = f"xgrammar {xgrammar['version']} (TensorRT-LLM {version}'s)"
    try:
        tokenizer = json.loads(tokenizer_str)
    except (TypeError, json.JSONDecodeError):
        tokenizer = None
    if not isinstance(tokenizer, dict):
        return [
            f"{path}: 'tokenizer_str' is not a JSON object, which {named} requires to detect the vocabulary; {REBUILD}"
        ]
    rules = xgrammar["detect_from_hf"]
    detected = detected_metadata(tokenizer, rules)["vocab_type"]
    wanted = rules["vocab_type"]["by_type"].get(BYTE_LEVEL)
    if _byte_level(tokenizer) and detected != wanted:
        return [
            f"{path}: the tokenizer splits text into byte-level tokens (a {BYTE_LEVEL} pre_tokenizer), but its "
            f"{rules['vocab_type']['field']} makes {named} take the vocabulary for {detected}, so guided decoding "
            f"would match every grammar against the wrong token text; give tokenizer.json a {BYTE_LEVEL} decoder (as "
            f"byte-level BPE checkpoints ship it) and {REBUILD}"
        ]
    return []


def tokenizer_info_problems(path: Path, version: str) -> list[str]:
    """What would stop the release's backend from loading the tokenizer info file at `path`: it must exist and hold
    every key the backend reads, each of the type the backend reads it as, and its `tokenizer_str` must read right in
    the xgrammar the release depends on (an empty list when it would load)."""
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
    return problems or xgrammar_problems(path, info.get("tokenizer_str"), version)


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
