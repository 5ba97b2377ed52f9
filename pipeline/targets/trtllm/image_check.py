"""The GPU image's check of its own Python environment, run while `docker build` makes it (see image.py).

Standard library only at import: `record` runs first, in the container's own python3, before anything of ours is
installed; the other steps run in our virtualenv, where the pipeline is installed, and import it.

    python3 -I image_check.py record --tensorrt-llm 1.2.1 DIR                   # the container's python3
    .venv/bin/python -I image_check.py compare --release 1.2 DIR                 # once the pipeline is installed
    .venv/bin/python -I image_check.py quantize --release 1.2 CONFIG [OVERRIDES]  # once the configs are copied

(-I keeps this file's directory off sys.path: its modelopt.py would shadow ModelOpt.)

`record` stops unless the container holds the TensorRT-LLM the stage was written for, then writes DIR/container.json
(version and file of each module below, and what the container's tensorrt_llm itself requires of ModelOpt and
transformers) and DIR/constraints.txt (pip constraints pinning their distributions to the container's versions, so
installing the pipeline cannot replace them; transformers where that tensorrt_llm requires it). `compare` stops unless
our virtualenv resolves each module to the very same file and version, and imports them (ModelOpt's quantization and
export included), and unless the container's ModelOpt is the one the release pins (tabulated from its release notes)
and satisfies what its tensorrt_llm requires. `quantize` runs a real `mtq.quantize` of a tiny Llama made in-process
with the ModelOpt config `modelopt_config` writes for the config's quantization section, and checks that the
quantizers it asks for are enabled: a ModelOpt whose API our code does not write for is reported, naming the release
and the fix, at image build time rather than at the container's first build. An import failing only for want of the
CUDA driver, which `docker build` does not mount, is reported and left to the container's first start.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

# module -> the distribution that installs it
MODULES = {
    "tensorrt_llm": "tensorrt_llm",
    "torch": "torch",
    "modelopt": "nvidia-modelopt",
    "transformers": "transformers",
}
REQUIRED = ("tensorrt_llm", "torch", "modelopt")  # every NVIDIA trtllm container has these; transformers if required
IMPORTED = ("tensorrt_llm", "torch", "transformers", "modelopt.torch.quantization", "modelopt.torch.export")
REQUIRED_BY_TRTLLM = {"nvidia-modelopt": "modelopt", "transformers": "transformers"}  # distribution -> module
NO_DRIVER = ("libcuda", "driver")  # what an import failing for want of a GPU driver names
RECORD, CONSTRAINTS = "container.json", "constraints.txt"
QUANTIZER = re.compile(r"_quantizer(\.\d+)?$")  # a ModelOpt quantizer module (.N: one of a SequentialQuantizer's)
TABLE = "pipeline/upstream/triton_trtllm_images.json"


def resolved() -> dict[str, dict]:
    """Where this interpreter finds each module and the version of the distribution that installed it."""
    found = {}
    for module, distribution in MODULES.items():
        spec = importlib.util.find_spec(module)
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found[module] = {"file": spec.origin if spec else None, "version": version, "distribution": distribution}
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def trtllm_requires() -> dict[str, str]:
    """What the installed tensorrt_llm requires (Requires-Dist, extras left out) of each REQUIRED_BY_TRTLLM
    distribution, as written there."""
    try:
        requires = importlib.metadata.requires("tensorrt_llm") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found = {}
    for line in requires:
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if name and normalized(name[0]) in REQUIRED_BY_TRTLLM and "extra ==" not in line.partition(";")[2]:
            found[normalized(name[0])] = line
    return found


def record(tensorrt_llm: str, directory: Path) -> str | None:
    found, requires = resolved(), trtllm_requires()
    needed = [*REQUIRED, *(REQUIRED_BY_TRTLLM[name] for name in requires if REQUIRED_BY_TRTLLM[name] not in REQUIRED)]
    missing = [module for module in needed if not found[module]["file"] or not found[module]["version"]]
    if missing:
        return f"the container's python3 ({sys.executable}) has no {', '.join(missing)}: is this NVIDIA's trtllm image?"
    if found["tensorrt_llm"]["version"] != tensorrt_llm:
        return (
            f"this container holds TensorRT-LLM {found['tensorrt_llm']['version']}, the stage was written for "
            f"{tensorrt_llm}: build the stage `trtllm-pipeline plan CONFIG` names, or re-tabulate {TABLE}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RECORD).write_text(json.dumps({"modules": found, "tensorrt_llm_requires": requires}, indent=1))
    constrained = [found[module] for module in needed]
    (directory / CONSTRAINTS).write_text("".join(f"{w['distribution']}=={w['version']}\n" for w in constrained))
    for module, where in found.items():
        print(f"container: {module} {where['version']} at {where['file']}")
    for line in requires.values():
        print(f"container: tensorrt_llm requires {line}")
    return None


def compare(directory: Path, release: str | None = None) -> str | None:
    recorded, ours = json.loads((directory / RECORD).read_text()), resolved()
    container = recorded["modules"]
    kept = [module for module in MODULES if container[module]["file"]]  # the container's own (transformers may lack)
    differing = [module for module in kept if ours[module] != container[module]]
    for module in kept:
        where = ours[module]
        print(f"{'differs' if module in differing else 'same'}: {module} {where['version']} at {where['file']}")
    if differing:
        return (
            f"{sys.executable} does not use the container's {', '.join(differing)}: the virtualenv must see the "
            "container's site-packages after its own and install nothing over them"
        )
    for module in IMPORTED:
        if container[module.split(".")[0]]["file"] is None:
            print(f"absent: {module} (the record has none)")
            continue
        try:
            importlib.import_module(module)
        except Exception as error:  # any import failure is reported; only a missing driver is not one
            if not any(word in str(error) for word in NO_DRIVER):
                return f"{module} does not import in {sys.executable}: {type(error).__name__}: {error}"
            print(
                f"resolved, not imported: {module} needs the CUDA driver, which `docker build` does not mount ({error})"
            )
            continue
        print(f"imported: {module}")
    problems = pin_problems(container, recorded.get("tensorrt_llm_requires", {}), release) if release else []
    return "; ".join(problems) or None


def release_facts(release: str) -> dict:
    from pipeline.targets.trtllm.image import container

    return container(release)


def pin_problems(container: dict, requires: dict[str, str], release: str) -> list[str]:
    """The container's ModelOpt against the release's tabulated pin, and its ModelOpt and transformers against what
    its own tensorrt_llm requires; the tabulated transformers version is printed beside the container's."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from pipeline.targets.trtllm.image import nvidia_image

    facts, problems = release_facts(release), []
    modelopt, pin = container["modelopt"]["version"], facts["modelopt"]["requirement"]
    if not SpecifierSet(pin).contains(modelopt, prereleases=True):
        problems.append(
            f"container ModelOpt {modelopt}, TensorRT-LLM {release} pins nvidia-modelopt{pin} (its release notes, "
            f"{TABLE}): fix: build this stage FROM {nvidia_image(release)} as NVIDIA ships it (its TensorRT-LLM "
            f"{facts['tensorrt_llm']} was built and tested with that ModelOpt); if that container itself holds "
            f"{modelopt}, re-tabulate the table and run tests/targets/test_modelopt_container_versions.py under it"
        )
    else:
        print(f"pinned: ModelOpt {modelopt} satisfies TensorRT-LLM {release}'s nvidia-modelopt{pin}")
    for distribution, line in requires.items():
        version = container[REQUIRED_BY_TRTLLM[distribution]]["version"]
        if version and not Requirement(line).specifier.contains(version, prereleases=True):
            problems.append(
                f"container {distribution} {version}, but its own tensorrt_llm {container['tensorrt_llm']['version']} "
                f"requires {line}: fix: build this stage FROM {nvidia_image(release)} as NVIDIA ships it"
            )
    noted, held = facts.get("transformers"), container["transformers"]["version"]
    if noted:
        same = "the version" if noted["version"] == held else f"not the version ({held})"
        print(f"transformers: TensorRT-LLM {noted['noted_in']}'s release notes name {noted['version']}, {same} held")
    return problems


def tiny_llama(device: str = "cpu"):
    """A randomly initialised (seeded) float32 2-layer Llama with grouped-query attention, made here (no download):
    every linear's input a multiple of 128, so any int4 group size divides it. scripts/modelopt_container_smoke.py
    quantizes it on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()


def quantize(config: Path, overrides: list[str], release: str) -> str | None:
    """A real `mtq.quantize` of `tiny_llama` with what the build's quantize stage would pass for the config's
    quantization section (its preset through modelopt_config, or its recipe), then the quantizers it enabled."""
    from pipeline.config.loading import read_config

    q = read_config(config, overrides).quantization
    try:
        import modelopt.torch.quantization as mtq
        import torch

        from pipeline.targets.trtllm.modelopt import (
            MODELOPT_PRESETS,
            UnsupportedModelOpt,
            installed_modelopt,
            modelopt_config,
            quiet_modelopt,
        )
    except Exception as error:
        if any(word in str(error) for word in NO_DRIVER):
            print(f"not quantized: ModelOpt needs the CUDA driver, which `docker build` does not mount ({error})")
            return None
        return f"ModelOpt does not import in {sys.executable}: {type(error).__name__}: {error}"
    version, facts = installed_modelopt(), release_facts(release)
    pinned = (
        f"TensorRT-LLM {release} pins nvidia-modelopt{facts['modelopt']['requirement']}, whose quant_cfg is a "
        f"{facts['modelopt']['quant_cfg']} ({TABLE})"
    )
    fix = (
        f"fix: make modelopt_config (pipeline/targets/trtllm/modelopt.py) write ModelOpt {version}'s config, and run "
        "tests/targets/test_modelopt_container_versions.py, which runs the quantize stage under a real older ModelOpt"
    )
    what = f"the preset {MODELOPT_PRESETS.get((q.weights, q.method), 'none (all quantizers disabled)')}"
    if q.modelopt_recipe:
        what = f"the recipe {q.modelopt_recipe}"
        try:
            from modelopt.recipe.loader import load_recipe
        except ImportError as error:
            return (
                f"container ModelOpt {version} has no modelopt.recipe ({error}) for quantization.modelopt_recipe; "
                f"{pinned}: fix: remove modelopt_recipe, so that the preset weights/method/kv_cache pick is used"
            )
        quant_config = load_recipe(q.modelopt_recipe).quantize.model_dump()
    else:
        try:
            quant_config = modelopt_config(q)
        except UnsupportedModelOpt as error:
            return f"container ModelOpt {version}: {error}; {pinned}: {fix}"
        except Exception as error:  # modelopt_config reading a preset of another shape fails in its own way
            return (
                f"container ModelOpt {version}: modelopt_config cannot write {what} for it: "
                f"{type(error).__name__}: {error}; {pinned}: {fix}"
            )
    model = tiny_llama()
    batches = [torch.randint(3, 320, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def forward_loop(m):
        with torch.no_grad():
            for batch in batches:
                m(batch)

    try:
        with quiet_modelopt():
            model = mtq.quantize(model, quant_config, forward_loop)
    except Exception as error:  # whatever ModelOpt raises on a config of another API is the finding
        return (
            f"container ModelOpt {version}: mtq.quantize refused the config for {what}: "
            f"{type(error).__name__}: {error}; {pinned}: {fix}"
        )
    enabled = sorted(
        name
        for name, module in model.named_modules()
        if QUANTIZER.search(name) and getattr(module, "is_enabled", False)
    )
    problems = quantizer_problems(enabled, q, (q.weights, q.method) in MODELOPT_PRESETS or bool(q.modelopt_recipe))
    if problems:
        found = "; ".join(problems)
        return f"container ModelOpt {version} quantized the tiny model with {what}, but {found}; {pinned}: {fix}"
    print(f"quantized: ModelOpt {version}, {what}: {len(enabled)} quantizers enabled on a tiny Llama")
    return None


def quantizer_problems(enabled: list[str], q, weights_quantized: bool) -> list[str]:
    """What the enabled quantizers (module names) lack of what the quantization section asks for."""
    from fnmatch import fnmatch

    problems = []
    if weights_quantized and not any(".weight_quantizer" in name for name in enabled):
        problems.append("no weight quantizer is enabled")
    if q.kv_cache != "none" and not any(re.search(r"[kv]_bmm_quantizer$", name) for name in enabled):
        problems.append(f"no KV-cache quantizer is enabled for kv_cache {q.kv_cache}")
    for pattern in q.exclude_modules:
        hit = [name for name in enabled if fnmatch(name.rsplit("_quantizer", 1)[0].rpartition(".")[0], pattern)]
        if hit:
            problems.append(f"exclude_modules {pattern!r} still has enabled quantizers ({', '.join(hit[:3])})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    record_step = steps.add_parser("record", help="in the container's python3: record its modules")
    record_step.add_argument("--tensorrt-llm", required=True, help="the TensorRT-LLM version the container must hold")
    record_step.add_argument("directory", type=Path)
    compare_step = steps.add_parser("compare", help="in our virtualenv: check it uses the recorded modules")
    compare_step.add_argument("--release", help="the TensorRT-LLM release whose ModelOpt pin the container must hold")
    compare_step.add_argument("directory", type=Path)
    quantize_step = steps.add_parser("quantize", help="in our virtualenv: mtq.quantize a tiny model with the config")
    quantize_step.add_argument("--release", required=True, help="the TensorRT-LLM release the stage is for")
    quantize_step.add_argument("config", type=Path)
    quantize_step.add_argument("overrides", nargs="*", help="the build's overrides (section.field=value)")
    args = parser.parse_args()
    if args.step == "record":
        problem = record(args.tensorrt_llm, args.directory)
    elif args.step == "compare":
        problem = compare(args.directory, args.release)
    else:
        problem = quantize(args.config, args.overrides, args.release)
    if problem:
        print(f"image check failed: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
