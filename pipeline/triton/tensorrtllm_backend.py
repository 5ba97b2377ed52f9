"""What each TensorRT-LLM release's `tensorrtllm` Triton backend and its `inflight_batcher_llm` templates
define, as tabulated from the upstream sources by scripts/dev/tabulate_trtllm_backend.py into
tensorrt_llm_templates.json (each entry records the files and commits it was read from).

Shared by the trtllm target (to generate the `tensorrt_llm` model) and the repository validator (to check
any repository against a release), so neither depends on the other.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from pipeline.errors import BuildStepError

TEMPLATES = Path(__file__).parent / "tensorrt_llm_templates.json"


@cache
def _table() -> dict:
    return json.loads(TEMPLATES.read_text())


# The releases the engine path targets: those whose backend facts are tabulated.
SUPPORTED_VERSIONS = tuple(_table())


def backend_facts(version: str) -> dict:
    """The tabulated facts of one release: source, models (templates), required/optional parameters."""
    table = _table()
    if version not in table:
        raise BuildStepError(
            f"no tensorrt_llm template tabulated for TensorRT-LLM {version} (have: {', '.join(table)}); "
            "tabulate it with scripts/dev/tabulate_trtllm_backend.py or target one of those"
        )
    return table[version]


def template(version: str) -> dict:
    """The `tensorrt_llm` model's template spec (inputs, outputs, parameter keys) of a release."""
    return backend_facts(version)["models"]["tensorrt_llm"]


def required_parameters(version: str) -> dict[str, str]:
    """Parameters the C++ backend of a release reads outside any try block (name -> C++ type of the read):
    a tensorrt_llm config lacking one of them fails to load ("Cannot find parameter with name")."""
    return dict(backend_facts(version)["required_parameters"])
