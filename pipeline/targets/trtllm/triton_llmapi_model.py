"""What Triton's `llmapi` python model (NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm) declares
and reads, per TensorRT-LLM release, as tabulated from the upstream sources by
scripts/dev/tabulate_all.py into pipeline/upstream/llmapi_model.json (each release records the files and commits it was
read from).

Its model.py reads model.yaml's `triton_config` in `auto_complete_config` (max_batch_size -> set_max_batch_size,
decoupled -> set_model_transaction_policy) and passes every other model.yaml key to `LLM(**kwargs)`.

It takes no guide (structured outputs) from a request in any tabulated release (`guide_inputs`): its helpers.py maps
no request tensor to SamplingParams' `guided_decoding`, so model.yaml's `guided_decoding_backend` only makes the
LLM ready for guides that this model never passes on.
"""

from __future__ import annotations

from pipeline.upstream import release_facts, releases

_TYPES = {"int": (int,), "bool": (bool,), "float": (int, float), "str": (str,)}
# The SamplingParams field holding a request's guide (GuidedDecodingParams), tensorrt_llm/sampling_params.py.
GUIDE_FIELD = "guided_decoding"


LLMAPI_RELEASES = releases("llmapi_model")


def llmapi_model(release: str) -> dict:
    """The tabulated facts of one release's llmapi model."""
    return release_facts("llmapi_model", release, "Triton's llmapi model")


def guide_inputs(release: str) -> list[str]:
    """The request tensors the release's llmapi model turns into a guide (SamplingParams' GUIDE_FIELD): the inputs
    its helpers.py maps to that field, as tabulated; none in 1.0 to 1.2."""
    return sorted(
        tensor for tensor, row in llmapi_model(release)["sampling_inputs"].items() if row["field"] == GUIDE_FIELD
    )


def model_yaml_problems(model_yaml: dict, release: str) -> list[str]:
    """What would make the release's model.py fail on (or ignore part of) this model.yaml: keys it reads without
    a fallback that are missing, `triton_config` keys it does not read, and values its conversion would not take
    as meant (e.g. `decoupled: "false"` is truthy under `bool(...)`)."""
    facts = llmapi_model(release)
    problems = []
    if not isinstance(model_yaml, dict):
        return [f"model.yaml must be a mapping, not {type(model_yaml).__name__}"]
    for dotted in facts["required_model_yaml_keys"]:
        node = model_yaml
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                problems.append(f"model.yaml lacks {dotted!r}, which model.py reads without a fallback")
                break
            node = node[part]
    triton_config = model_yaml.get("triton_config")
    if triton_config is not None and not isinstance(triton_config, dict):
        problems.append(f"model.yaml triton_config must be a mapping, not {type(triton_config).__name__}")
        triton_config = {}
    known = facts["triton_config"]
    for key, value in (triton_config or {}).items():
        if key not in known:
            problems.append(
                f"triton_config.{key} is not read by TensorRT-LLM {release}'s model.py (it reads: {', '.join(known)})"
            )
            continue
        conversion = known[key].get("conversion")
        expected = _TYPES.get(conversion)
        if expected and (not isinstance(value, expected) or (conversion == "int" and isinstance(value, bool))):
            problems.append(
                f"triton_config.{key} is {value!r} ({type(value).__name__}); model.py applies {conversion}()"
            )
    excluded = set(facts["llm_kwargs"]["excluded_model_yaml_keys"])
    for key in facts["llm_kwargs"]["set_by_model"]:
        if key in model_yaml and key not in excluded:
            problems.append(f"model.yaml sets {key!r}, which model.py itself sets for LLM() in some cases")
    return problems
