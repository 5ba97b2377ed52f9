"""Rewrite the GPU stages of the root Dockerfile from the container facts (pipeline/targets/trtllm/image.py), or
check them (--check: exit 1 when they differ). Maintainer tool; tests/targets/test_gpu_image.py runs the check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.targets.trtllm.image import BEGIN, END, stages  # noqa: E402


def rendered(dockerfile: str) -> str:
    """`dockerfile` with the text from the BEGIN line through the END line replaced by the current stages."""
    head, begin, rest = dockerfile.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END + "\n")
    if not begin or not end:
        raise SystemExit(f"the Dockerfile lacks the marker lines:\n{BEGIN}\n{END}")
    return head + stages() + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the stages are not current")
    args = parser.parse_args()
    path = ROOT / "Dockerfile"
    current, made = path.read_text(), rendered(path.read_text())
    if current == made:
        print("Dockerfile: GPU stages current")
        return 0
    if args.check:
        print("Dockerfile: GPU stages differ from the facts: run python scripts/dev/render_dockerfile.py")
        return 1
    path.write_text(made)
    print("Dockerfile: GPU stages written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
