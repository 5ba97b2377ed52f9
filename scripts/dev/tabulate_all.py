"""Regenerate the upstream fact tables in pipeline/upstream/ from the sources they cite, or check them (--check).

Maintainer tool: `make test` never runs it, and the pipeline never reads upstream sources. Each table's tabulator
reads the files it cites (repository, path, commit) through `Upstream`: from --sources DIR
(<DIR>/<owner>/<name>/<commit>/<path>), else downloaded from raw.githubusercontent.com into it.

    python scripts/dev/tabulate_all.py --check          # every table: each difference, or what it could not read
    python scripts/dev/tabulate_all.py --only llm_args  # rewrite one table
    make tables                                     # the same as the first line

Exit status: 0 when every table checked equals its regeneration, 1 when one differs, 2 when a source was missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import jsonpatch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from upstream_source import DEFAULT_SOURCES, SourceMissing, Upstream  # noqa: E402

from pipeline.upstream import TABLES, compact  # noqa: E402

# table (pipeline/upstream/<table>.json) -> the module in scripts/dev that tabulates it
TABULATORS = {
    "tensorrtllm_backend": "tabulate_trtllm_backend",
    "sampling_checks": "tabulate_sampling_checks",
    "cpu_llm_interface": "tabulate_cpu_llm_interface",
    "llm_args": "tabulate_trtllm_llm_args",
    "trtllm_serving": "tabulate_trtllm_serving",
    "trtllm_response_format": "tabulate_trtllm_response_format",
    "llmapi_model": "tabulate_trtllm_llmapi_model",
    "trtllm_torch_loader": "tabulate_trtllm_torch_loader",
    "trtllm_torch_models": "tabulate_trtllm_torch_models",
    "trtllm_checkpoint": "tabulate_trtllm_checkpoint",
    "trtllm_engine_models": "tabulate_trtllm_engine_models",
    "trtllm_build_flags": "tabulate_trtllm_build",
    "trtllm_lora": "tabulate_trtllm_lora",
    "trtllm_prequantized": "tabulate_trtllm_prequantized",
    "leaderworkerset": "tabulate_lws",
    "prometheus_adapter": "tabulate_prometheus_adapter",
    "triton_trtllm_images": "tabulate_triton_trtllm_images",
    "trtllm_pytorch_features": "tabulate_trtllm_pytorch_features",
    "trtllm_dtype": "tabulate_trtllm_dtype",
}


def differences(committed: dict, made: dict, limit: int = 20) -> list[str]:
    """The JSON Patch operations turning the committed table into the regenerated one, one line each."""
    operations = jsonpatch.make_patch(committed, made).patch
    lines = [
        f"  {op['op']} {op['path']}" + (f" = {json.dumps(op['value'])[:120]}" if "value" in op else "")
        for op in operations
    ]
    return lines[:limit] + ([f"  ... and {len(lines) - limit} more"] if len(lines) > limit else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed tables; write nothing")
    parser.add_argument("--only", action="append", choices=sorted(TABULATORS), help="only this table (repeatable)")
    parser.add_argument(
        "--sources", type=Path, default=DEFAULT_SOURCES, help=f"upstream files (default {DEFAULT_SOURCES})"
    )
    parser.add_argument("--offline", action="store_true", help="never download: read --sources only")
    args = parser.parse_args()
    upstream, status = Upstream(args.sources, download=not args.offline), 0
    for table in args.only or TABULATORS:
        path = TABLES / f"{table}.json"
        try:
            made = importlib.import_module(TABULATORS[table]).tabulate(upstream)
        except SourceMissing as missing:
            print(f"{table}: not regenerated: {missing}")
            status = max(status, 2)
            continue
        committed = json.loads(path.read_text()) if path.is_file() else {}
        if path.is_file() and compact(made) == path.read_text():
            print(f"{table}: reproduced ({path.stat().st_size:,} bytes)")
        elif args.check:
            print(f"{table}: differs from the committed table:", *differences(committed, made), sep="\n")
            status = max(status, 1)
        else:
            path.write_text(compact(made))
            print(f"{table}: written ({path.stat().st_size:,} bytes)")
    return status


if __name__ == "__main__":
    sys.exit(main())
