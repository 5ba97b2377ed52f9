#!/usr/bin/env python
"""Run a batch of prompts through a built engine: the same as `trtllm-pipeline run`.

Example:
    python scripts/run_batch.py build_configs/smollm2-135m-cpu.yaml --chat -i prompts.txt --output-file results.jsonl
"""

import sys

from pipeline.cli import app

if __name__ == "__main__":
    sys.exit(app(["run", *sys.argv[1:]]))
