"""Every file the shipped configs generate on this machine, hashed, to show that a refactor changed none of them.

For each `build_configs/*.yaml` it runs the real CLI: `build` as far as this machine goes (exit 4 is a GPU step
it cannot take) and `deploy`. A config whose checkpoint is not here (the Llama 3.1 examples) is deployed on its
published config.json shape, in a fixed directory, so that the manifests that mount it compare byte for byte.
Beyond what the configs target, for every trtllm config and every release it could target: the LLM-API options
file (PyTorch backend) and the Triton repository rendered from an engine record as trtllm-build writes it (engine
backend; the engine itself needs a GPU) under `<output>/releases/`, so every release's tables are exercised.
Run it on two versions of the code with the same OUT (a kept build is re-run only where its lock changed), and
compare the two `generated.sha256` files:

    python scripts/dev/generated_outputs.py /tmp/generated && cp /tmp/generated/generated.sha256 before.sha256
    ... change the code ...
    python scripts/dev/generated_outputs.py /tmp/generated && diff before.sha256 /tmp/generated/generated.sha256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import llama_shape  # noqa: E402  (the published Llama 3.1 shapes the tests deploy too)

COMPARED = (
    "triton_repo",
    "engine/llm_api_options.yaml",
    "engine/config.json",
    "export/trtllm_checkpoint",
    "deploy/k8s",
    "releases",
)
LLAMA_SIZES = {"llama-3.1-8b": "8b", "llama-3.1-70b": "70b"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True)


def shape_override(config: Path, shapes: Path) -> list[str]:
    """`model.path=` a published shape when the config's checkpoint is not on this machine."""
    model = yaml.safe_load(config.read_text())["model"]
    if model.get("source") != "hf" or Path(model["path"]).exists():
        return []
    size = next(size for prefix, size in LLAMA_SIZES.items() if config.stem.startswith(prefix))
    shape = shapes / size
    if not shape.is_dir():
        shape.parent.mkdir(parents=True, exist_ok=True)
        llama_shape(shape.parent, size)
    claim = [] if "deploy" in yaml.safe_load(config.read_text()) else ["deploy.storage.models_claim=models"]
    return [f"model.path={shape}", *claim]


def every_release(config: Path, extra: list[str], output: Path) -> None:
    """The options file and the tensorrt backend's repository of each release the tables hold, for a trtllm config."""
    from pipeline.errors import PipelineError
    from pipeline.stages import triton_repo
    from pipeline.targets.trtllm.pytorch_backend import options_yaml, release_options
    from pipeline.validation import load_config

    try:
        cfg = load_config(REPO / config, extra)
    except PipelineError:  # its build and deploy lines above say why
        return
    if cfg.target.name != "trtllm":
        return
    out = output / "releases"
    out.mkdir(exist_ok=True)
    for release in ("1.0", "1.1", "1.2"):
        overrides = [*extra, "target.trtllm_backend=pytorch", f'target.trtllm_version="{release}"']
        try:
            pytorch = load_config(REPO / config, overrides)
            text = options_yaml(pytorch, release_options(pytorch)[0])
        except PipelineError as refused:
            text = f"refused: {refused}"
        (out / f"llm_api_options-{release}.yaml").write_text(text.replace(str(REPO), "<repo>"))
    tokenizer = output / "import"
    if not tokenizer.is_dir():
        return
    for release in ("0.18", "0.19", "0.20", "0.21", "1.0", "1.1", "1.2"):
        overrides = [*extra, "target.trtllm_backend=tensorrt", f'target.trtllm_version="{release}"']
        try:
            engines = load_config(REPO / config, overrides)
        except PipelineError as refused:
            (out / f"repo-{release}.refused").write_text(str(refused).replace(str(REPO), "<repo>"))
            continue
        record = out / f"engine-{release}"
        record.mkdir(exist_ok=True)
        for file in tokenizer.glob("tokenizer*"):
            (record / file.name).write_bytes(file.read_bytes())
        build = {"max_batch_size": engines.build.max_batch_size, "max_input_len": engines.build.max_input_len}
        build |= {"max_seq_len": engines.build.max_seq_len, "max_num_tokens": engines.build.max_num_tokens}
        (record / "config.json").write_text(
            json.dumps(
                {
                    "version": f"{release}.0",
                    "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16"},
                    "build_config": {**build, "max_beam_width": 1},
                }
            )
        )
        repo = out / f"repo-{release}"
        shutil.rmtree(repo, ignore_errors=True)
        try:
            triton_repo.write(engines, record, repo, log=lambda _: None)
        except PipelineError as refused:
            (out / f"repo-{release}.refused").write_text(str(refused).replace(str(REPO), "<repo>"))


def compared_files(output: Path) -> list[Path]:
    files = []
    for name in COMPARED:
        path = output / name
        files += (
            [path]
            if path.is_file()
            else sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output root: one build per config under it, and generated.sha256")
    parser.add_argument("--config", action="append", type=Path, help="only these configs (default: build_configs/*)")
    args = parser.parse_args()
    out, lines = args.out.resolve(), []
    for config in args.config or sorted((REPO / "build_configs").glob("*.yaml")):
        config = config.resolve().relative_to(REPO)
        output, extra = out / config.stem, shape_override(REPO / config, out / "shapes")
        steps = [("deploy", cli("deploy", str(config), *extra, "--output", str(output)))]
        if not extra:
            steps.insert(0, ("build", cli("build", str(config), "--output", str(output))))
        for verb, result in steps:
            said = (result.stderr.strip().splitlines() or [""])[-1] if result.returncode else ""
            print(f"{config}: {verb} exit {result.returncode} {said}", flush=True)
            lines.append(f"{config.stem} {verb} exit {result.returncode} {said}".rstrip())
        every_release(config, extra, output)
        for file in compared_files(output):
            lines.append(f"{hashlib.sha256(file.read_bytes()).hexdigest()}  {file.relative_to(out)}")
    (out / "generated.sha256").write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} lines in {out / 'generated.sha256'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
