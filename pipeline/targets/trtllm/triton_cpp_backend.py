"""What each TensorRT-LLM release's `tensorrtllm` Triton backend and its `inflight_batcher_llm` templates
define, as tabulated from the upstream sources into pipeline/upstream/tensorrtllm_backend.json (each release
records the files and commits it was read from).

Shared by the trtllm target (to generate the `tensorrt_llm` model) and the repository validator (to check
any repository against a release), so neither depends on the other.
"""

from __future__ import annotations

from pipeline.upstream import release_facts, releases

# The releases the engine path targets: those whose backend facts are tabulated.
SUPPORTED_VERSIONS = releases("tensorrtllm_backend")


def backend_facts(version: str) -> dict:
    """The tabulated facts of one release: source, models (templates), required/optional parameters."""
    return release_facts("tensorrtllm_backend", version, "The tensorrt_llm Triton backend")


def template(version: str) -> dict:
    """The `tensorrt_llm` model's template spec (inputs, outputs, parameter keys) of a release."""
    return backend_facts(version)["models"]["tensorrt_llm"]


def required_parameters(version: str) -> dict[str, str]:
    """Parameters the C++ backend of a release reads outside any try block (name -> C++ type of the read):
    a tensorrt_llm config lacking one of them fails to load ("Cannot find parameter with name")."""
    return dict(backend_facts(version)["required_parameters"])
