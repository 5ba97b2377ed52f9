"""Tabulate the interface of TensorRT-LLM's Triton `tensorrt_llm` model that the onnxruntime target's LLM model
mirrors into pipeline/upstream/cpu_llm_interface.json (run by scripts/dev/tabulate_all.py).

The CPU model takes requests as tensorrtllm_backend `MIRRORED` takes them, so a client of a GPU deployment works
against a CPU one. Its facts live in a table of their own, not in tensorrtllm_backend.json's per-release blocks, so
that tabulating another TensorRT-LLM release changes nothing a CPU build hashes (the build lock follows the tables a
module reads: pipeline/lock_sources.py).

- `guide_types`: the `guided_decoding_guide_type` strings the release's utils.cc accepts (`tabulate_trtllm_backend.
  guide_types`).
"""

from __future__ import annotations

from tabulate_trtllm_backend import _read, guide_types, release_files
from upstream_source import Upstream

MIRRORED = "0.19"


def tabulate(upstream: Upstream) -> dict:
    utils = next(source for source in release_files(MIRRORED)[1] if source["path"].endswith("/utils.cc"))
    return {"mirrors": MIRRORED, "source": utils, "guide_types": guide_types(_read(upstream, utils))}
