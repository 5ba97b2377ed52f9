#!/usr/bin/env python
"""ModelOpt as a TensorRT-LLM container ships it quantizing with the pipeline's config: the check modelopt-container
of scripts/gpu_check.py, which runs this file (`check`) with that ModelOpt's directory first on PYTHONPATH.

The TensorRT-LLM 1.1 and 1.2 containers ship nvidia-modelopt ~=0.37, whose `quant_cfg` is a dict of patterns (0.44
made it a list of entries), and in our GPU image that ModelOpt calibrates. This quantizes a tiny random Llama on
`--device` with `pipeline.targets.trtllm.modelopt.modelopt_config` of build_configs/smollm2-135m-fp8.yaml's
quantization section and passes when `mtq.quantize` runs and the quantizers are where that section asks: the weight
and input quantizers of every decoder linear FP8 (E4M3, per tensor) and calibrated, the k/v attention quantizers FP8
and calibrated for the FP8 KV cache, and every other quantizer (lm_head's, the outputs', q's) disabled.
Prints `PASS modelopt-container: ...` or `FAIL modelopt-container: ...` as its last stdout line.

  PYTHONPATH=.gpu_check/modelopt-0.37 .venv/bin/python scripts/modelopt_container_smoke.py [--device cpu]
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pipeline.targets.trtllm.image_check import tiny_llama  # torch and transformers are imported when it runs

REPO = Path(__file__).resolve().parents[1]
FP8_CONFIG = REPO / "build_configs" / "smollm2-135m-fp8.yaml"
NAME = "modelopt-container"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3 = (4, 3)


def expected_state(name: str, q) -> tuple | None:
    """(num_bits, axis) the quantizer `name` must have, enabled and calibrated, for the FP8 section `q`; None when it
    must be disabled."""
    module, _, quantizer = name.rpartition(".")
    if any(fnmatch.fnmatch(module, f"*{pattern}*") for pattern in q.exclude_modules):
        return None
    if module.startswith("model.layers.") and module.endswith(LINEARS):
        return (E4M3, None) if quantizer in ("weight_quantizer", "input_quantizer") else None
    if quantizer in ("k_bmm_quantizer", "v_bmm_quantizer") and q.kv_cache == "fp8":
        return (E4M3, None)
    return None


def placement_problems(model, q) -> tuple[list[str], dict]:
    """Where the model's quantizers differ from what `q` asks, and how many are enabled of each kind."""
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer

    problems, counts = [], {"linear": 0, "kv": 0, "disabled": 0}
    quantizers = {name: m for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}
    if not quantizers:
        return ["no quantizer was inserted"], counts
    for name, quantizer in quantizers.items():
        expected = expected_state(name, q)
        if expected is None:
            counts["disabled"] += 1
            if quantizer.is_enabled:
                problems.append(f"{name} enabled ({quantizer}), expected disabled")
            continue
        counts["kv" if "bmm" in name else "linear"] += 1
        amax = getattr(quantizer, "amax", None)
        got = (tuple(quantizer.num_bits) if isinstance(quantizer.num_bits, (list, tuple)) else quantizer.num_bits,)
        if not quantizer.is_enabled:
            problems.append(f"{name} disabled, expected FP8")
        elif got + (quantizer.axis,) != expected:
            problems.append(f"{name}: num_bits {got[0]}, axis {quantizer.axis}; expected {expected}")
        elif amax is None or amax.numel() != 1 or not bool(torch.isfinite(amax).all() and (amax > 0).all()):
            problems.append(f"{name}: amax {amax}, expected one calibrated per-tensor value")
    layers = model.config.num_hidden_layers
    if counts["linear"] != 2 * len(LINEARS) * layers:
        problems.append(f"{counts['linear']} linear quantizers, expected {2 * len(LINEARS) * layers}")
    if q.kv_cache == "fp8" and counts["kv"] != 2 * layers:
        problems.append(f"{counts['kv']} k/v attention quantizers, expected {2 * layers}")
    return problems, counts


def skip_cuda_extensions() -> None:
    """ModelOpt compiles its CUDA fake-quant kernels on first use (about 100 s on an H200, beside the 0.47 ones the
    main check compiles): a cached None makes its getters return none, and it falls back to its eager path. This check
    is about the placement, not the kernels."""
    from modelopt.torch.quantization import extensions

    for getter in ("get_cuda_ext", "get_cuda_ext_fp8", "get_cuda_ext_mx"):
        if hasattr(extensions, getter):
            getattr(extensions, getter).extension = None


def smoke(device: str) -> tuple[str, str]:
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers

    from pipeline.targets.trtllm.modelopt import modelopt_config
    from pipeline.validation import load_config

    where = f"ModelOpt {modelopt.__version__} ({Path(modelopt.__file__).parent.parent}), transformers "
    where += f"{transformers.__version__}, torch {torch.__version__}"
    if device == "cuda":
        skip_cuda_extensions()
    q = load_config(FP8_CONFIG).quantization
    config = modelopt_config(q)
    shape = f"quant_cfg a {type(config.get('quant_cfg')).__name__} of {len(config.get('quant_cfg') or ())} entries"
    model = tiny_llama(device)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (2, 32), generator=generator) for _ in range(4)]

    def forward_loop(m):
        with torch.no_grad():
            for batch in batches:
                m(batch.to(device))

    start = time.monotonic()
    try:
        model = mtq.quantize(model, config, forward_loop)
    except Exception as exc:
        traceback.print_exc()
        return "FAIL", f"{where}: mtq.quantize with modelopt_config's {shape} raised {type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    problems, counts = placement_problems(model, q)
    text = (
        f"{where}: mtq.quantize of a {model.config.num_hidden_layers}-layer Llama on {device} with modelopt_config's "
        f"{shape} ({seconds:.1f} s): {counts['linear']} linear weight/input quantizers and {counts['kv']} k/v "
        f"attention quantizers FP8 per-tensor and calibrated, {counts['disabled']} disabled"
    )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return "FAIL", f"{text}; not as {FP8_CONFIG.name} asks: {'; '.join(problems[:5])}{more}"
    return "PASS", f"{text}, as {FP8_CONFIG.name} asks"


def check(modelopt_dir: Path, device: str, timeout: int = 300) -> tuple[str, str, None]:
    """scripts/gpu_check.py's check: this file run in a Python of its own with `modelopt_dir` first on its path
    (15 s on CPU here); its stderr goes to ours."""
    if not (modelopt_dir / "modelopt").is_dir():
        return (
            "SKIP",
            f"no ModelOpt in {modelopt_dir} (scripts/dev/gpu_check_carry.py puts the containers' there)",
            None,
        )
    path = os.pathsep.join(p for p in (str(modelopt_dir), str(REPO), os.environ.get("PYTHONPATH")) if p)
    print(f"{NAME}: {Path(__file__).name} with {modelopt_dir} first on PYTHONPATH", file=sys.stderr, flush=True)
    result = subprocess.run(
        [sys.executable, __file__, "--device", device],
        env=os.environ | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    sys.stderr.write(result.stderr)
    status, _, text = (result.stdout.strip().splitlines() or [""])[-1].partition(" ")
    if status not in ("PASS", "FAIL") or not text.startswith(f"{NAME}: "):
        return "FAIL", f"{Path(__file__).name} exited {result.returncode} without a verdict (its stderr is above)", None
    return status, text.removeprefix(f"{NAME}: "), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    out = sys.stdout
    try:
        sys.stdout = sys.stderr  # ModelOpt prints progress: stdout's last line is the verdict
        status, text = smoke(args.device)
    except Exception as exc:
        traceback.print_exc()
        status, text = "FAIL", f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout = out
    print(f"{status} {NAME}: {text}", flush=True)
    return 0 if status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
