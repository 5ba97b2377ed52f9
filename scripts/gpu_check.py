#!/usr/bin/env python
"""Checks on an NVIDIA GPU what the trtllm target predicts on CPU; needs torch with CUDA and nvidia-modelopt, not
TensorRT-LLM.

  export/<config>     ModelOpt calibration of the default model (SmolLM2-135M-Instruct as the pipeline imports it)
                      on the GPU for build_configs/smollm2-135m-fp8.yaml and smollm2-135m-int4-awq.yaml (the
                      pipeline's quantize stage with the GPU as torch's default device), exported by the pipeline's
                      export stage, against the same on CPU: the same files, tensor names, shapes and dtypes, the
                      same JSON files (config.json, hf_quant_config.json), scales within {scale_rtol:.2e} relative.
  fp8-forward         the FP8 checkpoint calibrated on the GPU run with FP8 GEMMs (torch._scaled_mm) against the
                      CPU reference forward of the quality gate (pipeline/targets/trtllm/reference.py) over the
                      built-in chat prompts: largest logits difference and top-1 agreement (at least {min_top1}).
                      SKIP below compute capability 8.9 (no FP8 GEMMs).
  memory-weights      the memory plan of the FP8 config (trtllm gpu_memory.py, as `plan` prints it) against that FP8
  memory-kv           model on the GPU: the bytes allocated for its weights (within {weights_rtol:.0%}); its cache's
  memory-activations  bytes per token at the FP8 cache's 1 byte a value (equal); the peak allocation above the
                      weights of one forward of max_num_tokens tokens in max_batch_size sequences
                      (torch.cuda.max_memory_allocated; at most {activations_ratio}x the plan's activations).

Prints one line per check, `PASS name: numbers`, `FAIL name: numbers and why` or `SKIP name: reason` (progress
goes to stderr), and exits 0 when nothing failed, 1 when a check failed, and 4 (the pipeline's exit code for a
machine that lacks what a GPU step needs) at once when torch sees no CUDA device. The built-in model and the
calibration text come from the pipeline's cache (fetched from PyPI by the import stage on first use).
Run from the repository root, with the pipeline installed (its targets are entry points):
.venv/bin/python scripts/gpu_check.py [--output DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FP8_CONFIG = REPO / "build_configs" / "smollm2-135m-fp8.yaml"
CONFIGS = (FP8_CONFIG, REPO / "build_configs" / "smollm2-135m-int4-awq.yaml")

# Both devices calibrate in float32, but the export derives INT4-AWQ's scales in float16 (the checkpoint dtype),
# where float32 rounding differences between the devices become float16 steps of up to 2^-10 of a value. Measured on
# an H200 (2026-11-26): FP8 scales identical, INT4-AWQ's at most 1.31e-3 apart; a calibration in another dtype or on
# fewer batches moves scales further.
SCALE_RTOL = 2**-9
# The reference computes in float32 what TensorRT-LLM and this forward compute in float16, and SmolLM2's logits are
# flat enough that float16 alone flips about a tenth of the top-1s: on an H200 (2026-11-26) this forward agreed on
# 0.894 of them, the reference itself run in float16 there on 0.888. So the bound catches what flips most (a wrong
# scale, layout or GEMM), not float16.
MIN_TOP1_AGREEMENT = 0.85
# The plan counts linear parameters at 1 byte (FP8) and the embedding and lm_head tables in float16; what it leaves
# out (norms, one scale per tensor) is under 0.1% of SmolLM2's weights.
WEIGHTS_RTOL = 0.01
# The plan's activation term budgets TensorRT-LLM's fused kernels; this forward runs transformers' unfused layers,
# so it only has to stay within this multiple of the plan (an error of the plan's order of magnitude exceeds it).
ACTIVATIONS_MAX_RATIO = 2.0
FP8_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm's FP8 GEMMs: Ada and Hopper
MiB = 1 << 20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Report:
    """The check lines, printed as they come and counted for the exit code."""

    def __init__(self):
        self.failed, self.out = 0, sys.stdout  # made before main sends stdout to stderr

    def line(self, status: str, name: str, text: str) -> None:
        self.failed += status == "FAIL"
        print(f"{status} {name}: {text}", file=self.out, flush=True)

    def run(self, name: str, check, *args):
        """`check(*args)` returns (status, text, result); an exception is a FAIL naming it (traceback on stderr),
        so that one broken check does not hide the others. Returns the result (None after an exception)."""
        try:
            status, text, result = check(*args)
        except Exception as exc:
            traceback.print_exc()
            status, text, result = "FAIL", f"{type(exc).__name__}: {exc}", None
        self.line(status, name, text)
        return result


# ---------------------------------------------------------------- 1. calibration on the GPU against CPU


def import_check(configs: list, output: Path):
    """The configs' one model imported by the pipeline's import stage into `output` (locked and reused as a
    build's is); its result is the imported checkpoint."""
    from rich.console import Console

    from pipeline.build import build

    if len({cfg.model.model_dump_json() for cfg in configs}) != 1:
        raise ValueError("the configs name different models; the check compares calibrations of one checkpoint")
    build(configs[0], output, Console(stderr=True), until="import")
    return "PASS", f"{configs[0].model.name or configs[0].model.path} in {output / 'import'}", output / "import"


def calibrate_and_export(cfg, hf_dir: Path, output: Path, device: str) -> Path:
    """The pipeline's quantize stage run with `device` as torch's default device (transformers then loads the
    model there and the calibration batches are made there), then its export stage as a build runs it (from the
    saved calibration, on CPU, checked for conformance). Returns the export directory."""
    import shutil

    import torch
    from rich.console import Console

    from pipeline.build import StageContext, cache_dir
    from pipeline.targets import target_of

    shutil.rmtree(output, ignore_errors=True)
    for stage in ("quantize", "export"):
        (output / stage).mkdir(parents=True)
    (output / "import").symlink_to(hf_dir.resolve(), target_is_directory=True)
    console, target = Console(stderr=True), target_of(cfg)
    log(f"{output.parent.name}: calibrating on {device}")
    with torch.device(device):
        target.quantize(cfg, StageContext(output / "quantize", output, cache_dir(), console))
    log(f"{output.parent.name}: exporting the {device} calibration")
    target.export(cfg, StageContext(output / "export", output, cache_dir(), console))
    return output / "export"


def read_checkpoint(directory: Path) -> tuple[dict, dict]:
    """(JSON files by name, tensors by `file:name`) of one exported checkpoint."""
    import json

    from safetensors.torch import load_file

    files = {f.name: json.loads(f.read_text()) for f in sorted(directory.glob("*.json"))}
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= {f"{file.name}:{name}": tensor for name, tensor in load_file(file).items()}
    return files, tensors


def is_scale(name: str) -> bool:
    """The unified checkpoint's scales (weight_scale, weight_scale_2, input_scale, pre_quant_scale, k_scale,
    v_scale) and the TensorRT-LLM checkpoint's (*_scaling_factor)."""
    return name.endswith(("_scale", "_scale_2", "scaling_factor"))


def relative_difference(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    return float(((a - b).abs() / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)).max()) if a.numel() else 0.0


def json_difference(a: dict | None, b: dict | None) -> str | None:
    """The top-level keys two JSON files differ in, or None when they are equal."""
    if a == b:
        return None
    a, b = a or {}, b or {}
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))) or "presence"


def compare_exports(cpu: Path, gpu: Path) -> tuple[list[str], dict]:
    """Where the GPU export directory's layout differs from the CPU one's, and the numbers: the largest relative
    scale difference (and where), and how many bytes of quantized weights (FP8, int8, packed int4) differ."""
    import torch

    problems, numbers = [], {"worst": 0.0, "where": "every scale identical", "changed": 0, "quantized": 0}
    checkpoints = sorted({p.name for p in cpu.iterdir() if p.is_dir()} | {p.name for p in gpu.iterdir() if p.is_dir()})
    for checkpoint in checkpoints:
        if not (cpu / checkpoint).is_dir() or not (gpu / checkpoint).is_dir():
            problems.append(f"{checkpoint}/ exported on one device only")
            continue
        (cpu_json, cpu_tensors), (gpu_json, gpu_tensors) = (
            read_checkpoint(cpu / checkpoint),
            read_checkpoint(gpu / checkpoint),
        )
        for name in sorted(set(cpu_json) | set(gpu_json)):
            if (keys := json_difference(cpu_json.get(name), gpu_json.get(name))) is not None:
                problems.append(f"{checkpoint}/{name} differs in {keys}")
        for name in sorted(set(cpu_tensors) ^ set(gpu_tensors)):
            problems.append(f"{checkpoint}/{name} only in the {'CPU' if name in cpu_tensors else 'GPU'} export")
        for name in sorted(set(cpu_tensors) & set(gpu_tensors)):
            a, b = cpu_tensors[name], gpu_tensors[name]
            if a.dtype != b.dtype or a.shape != b.shape:
                problems.append(f"{checkpoint}/{name}: {b.dtype} {list(b.shape)}, on CPU {a.dtype} {list(a.shape)}")
            elif is_scale(name):
                difference = relative_difference(a, b)
                if difference > numbers["worst"]:
                    numbers |= {"worst": difference, "where": f"{checkpoint}/{name}"}
            elif a.element_size() == 1:  # FP8, int8, or int4 pairs in a byte
                numbers["changed"] += int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                numbers["quantized"] += a.numel()
    return problems, numbers


def export_check(cfg, hf_dir: Path, output: Path, device: str):
    """Check 1 for one config; its result is the export calibrated on `device`."""
    cpu = calibrate_and_export(cfg, hf_dir, output / "cpu", "cpu")
    other = calibrate_and_export(cfg, hf_dir, output / device, device)
    problems, numbers = compare_exports(cpu, other)
    exported = ", ".join(sorted(p.name for p in other.iterdir() if p.is_dir()))
    text = (
        f"{exported}: largest scale difference {numbers['worst']:.2e} relative ({numbers['where']}; tolerance "
        f"{SCALE_RTOL:.2e}); {numbers['changed']:,} of {numbers['quantized']:,} quantized weight bytes differ"
    )
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        return "FAIL", f"{text}; layout differs from the CPU export: {'; '.join(problems[:10])}{more}", other
    if numbers["worst"] > SCALE_RTOL:
        return "FAIL", f"{text}; a scale is beyond the tolerance", other
    return "PASS", f"{text}; layout identical to the CPU export", other


# ---------------------------------------------------------------- 2. FP8 GEMMs against the CPU reference


def fp8_linear(weight, weight_scale, input_scale):
    """y = x W^T as an FP8 linear computes it on Hopper: x quantized per tensor by `input_scale`, one FP8 GEMM of
    it with `weight` (FP8, [out, in]) scaled by both scales, out in x's dtype. Rows are zero-padded to a multiple of
    16, as torch._scaled_mm requires of the other dimensions (the padding's outputs are dropped)."""
    import torch

    from pipeline.targets.trtllm.reference import FP8_MAX

    class FP8Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("weight", weight)
            self.register_buffer("weight_scale", weight_scale)
            self.register_buffer("input_scale", input_scale)

        def forward(self, x):
            rows = x.reshape(-1, x.shape[-1])
            quantized = (rows / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            padded = torch.nn.functional.pad(quantized.view(torch.uint8), (0, 0, 0, -len(rows) % 16))
            out = torch._scaled_mm(
                padded.view(torch.float8_e4m3fn),
                self.weight.t(),
                scale_a=self.input_scale,
                scale_b=self.weight_scale,
                out_dtype=x.dtype,
            )
            return out[: len(rows)].reshape(*x.shape[:-1], -1)

    return FP8Linear()


def on_device(reference, dtype, device: str):
    """A copy of the reference model (its fake-quantizing hooks too) in `dtype` on `device`, its buffers (RoPE
    frequencies) kept float32 as transformers makes them."""
    import copy

    model = copy.deepcopy(reference).to(device=device, dtype=dtype)
    for name, buffer in reference.named_buffers():
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, buffer.to(device))
    return model.eval()


def fp8_model(reference, unified_dir: Path, release: str, device: str):
    """The reference's transformers model in the checkpoint dtype on `device` with each FP8 linear an FP8 GEMM of
    the checkpoint's FP8 values and scales as TensorRT-LLM `release`'s PyTorch backend loads them (fused q/k/v and
    gate/up requantized to their largest weight scale: reference.unified_linears). The rest is the reference's:
    norms, RoPE, attention, and the FP8 KV cache's rounding of k/v (its hooks)."""
    import json

    import torch

    from pipeline.targets.trtllm.reference import unified_checkpoint, unified_linears
    from pipeline.targets.trtllm.torch_checkpoint import family, loader_groups

    algo = json.loads((unified_dir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    if algo != "FP8":
        raise ValueError(f"{unified_dir}: quant_algo {algo}, not FP8")
    config, dtype, tensors = unified_checkpoint(unified_dir)
    model = on_device(reference, dtype, device)
    fused = family(config, release)["fused_checkpoint_linears"]
    replaced = 0
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}"
        for group in loader_groups(fused):
            weights, hook = unified_linears(
                tensors, prefix, group, algo, dtype, fused=len(group) > 1 or group[0] in fused
            )
            if hook is None:  # excluded from quantization: stays the reference's float linear
                continue
            weight_scale = torch.stack([tensors[f"{prefix}.{m}.weight_scale"].float().reshape(()) for m in group]).max()
            for module_name, weight in zip(group, weights):
                parent, _, attr = f"{prefix}.{module_name}".rpartition(".")
                new = fp8_linear(
                    (weight / weight_scale).to(torch.float8_e4m3fn).to(device),
                    weight_scale.to(device),
                    hook[1].float().to(device),
                )
                for output_hook in model.get_submodule(f"{prefix}.{module_name}")._forward_hooks.values():
                    new.register_forward_hook(output_hook)  # the FP8 KV cache's rounding of k_proj / v_proj
                setattr(model.get_submodule(parent), attr, new)
                replaced += 1
    if not replaced:
        raise ValueError(f"{unified_dir}: no FP8 linear")
    return model


def fp8_forward_check(cfg, export_dir: Path, hf_dir: Path, device: str):
    """Check 2; its result is (the FP8 model on `device`, the bytes the allocator gave it), None when skipped."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.quality import chat_prompts
    from pipeline.targets.trtllm.reference import load_unified_reference

    cuda = device == "cuda"
    if cuda and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        capability = "{}.{}".format(*torch.cuda.get_device_capability())
        return "SKIP", f"{torch.cuda.get_device_name()} has compute capability {capability}; FP8 GEMMs need 8.9", None
    unified_dir = export_dir / "hf_unified"
    log(f"fp8-forward: the CPU reference and the FP8 GEMM model of {unified_dir}")
    reference = load_unified_reference(unified_dir, hf_dir, cfg.target.trtllm_version)
    before = torch.cuda.memory_allocated() if cuda else 0
    model = fp8_model(reference, unified_dir, cfg.target.trtllm_version, device)
    held = torch.cuda.memory_allocated() - before if cuda else None
    # the reference itself (fake quantization) in the same dtype on the same device: what the dtype alone moves
    same_dtype = on_device(reference, model.dtype, device)  # the checkpoint's dtype, as fp8_model runs it
    prompts = chat_prompts(AutoTokenizer.from_pretrained(hf_dir))
    scores = {"fp8": [0, 0.0], "same_dtype": [0, 0.0]}  # top-1 agreements, largest logits difference
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            expected = reference(ids).logits[0].double()
            for name, run in (("fp8", model), ("same_dtype", same_dtype)):
                got = run(ids.to(device)).logits[0].double().cpu()
                scores[name][0] += int((got.argmax(-1) == expected.argmax(-1)).sum())
                scores[name][1] = max(scores[name][1], float((got - expected).abs().max()))
    del same_dtype
    positions = sum(map(len, prompts))
    top1 = scores["fp8"][0] / positions
    text = (
        f"{len(prompts)} chat prompts, {positions:,} positions on {device}: top-1 agreement with the CPU reference "
        f"{top1:.4f} (at least {MIN_TOP1_AGREEMENT}), largest logits difference {scores['fp8'][1]:.3f}; the "
        f"reference in {str(model.dtype).removeprefix('torch.')} there without FP8 GEMMs: "
        f"{scores['same_dtype'][0] / positions:.4f}, {scores['same_dtype'][1]:.3f}"
    )
    return ("PASS" if top1 >= MIN_TOP1_AGREEMENT else "FAIL"), text, (model, held)


# ---------------------------------------------------------------- 3. the memory plan against the allocator

MEMORY_CHECKS = ("memory-weights", "memory-kv", "memory-activations")


def memory_checks(report: Report, cfg, fp8) -> None:
    import torch

    from pipeline.targets.trtllm.backend import backend_of

    if not torch.cuda.is_available():
        for name in MEMORY_CHECKS:
            report.line("SKIP", name, "the allocator's statistics need a CUDA device (a --device cpu dry run)")
        return
    if fp8 is None:
        for name in MEMORY_CHECKS:
            report.line("SKIP", name, "needs the FP8 model of fp8-forward, which did not run")
        return
    model, held = fp8
    plan = backend_of(cfg).memory_plan(cfg, cfg.model_facts())
    relative = held / plan.weights_bytes - 1
    report.line(
        "PASS" if abs(relative) <= WEIGHTS_RTOL else "FAIL",
        "memory-weights",
        f"{held / MiB:.1f} MiB allocated for the FP8 model, planned {plan.weights_bytes / MiB:.1f} MiB "
        f"({relative:+.2%}; tolerance {WEIGHTS_RTOL:.0%})",
    )
    rows, length = cfg.build.max_batch_size, cfg.build.max_num_tokens // cfg.build.max_batch_size
    ids = torch.randint(0, model.config.vocab_size, (rows, length), device=model.device)
    stored = torch.finfo(next(model.parameters()).dtype).bits // 8  # this forward keeps k/v in the model dtype
    with torch.no_grad():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(ids[:, :1], use_cache=True)
        cache = torch.cuda.memory_allocated() - before - out.logits.numel() * out.logits.element_size()
        per_token = cache // rows // stored  # at 1 byte a value, as the FP8 KV cache stores it
        del out
        report.line(
            "PASS" if per_token == plan.kv_bytes_per_token else "FAIL",
            "memory-kv",
            f"the cache of one token took {cache // rows:,} bytes at {stored} a value: {per_token:,} at the FP8 "
            f"cache's 1, planned {plan.kv_bytes_per_token:,} (must be equal)",
        )
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    ratio = peak / plan.activation_bytes
    report.line(
        "PASS" if ratio <= ACTIVATIONS_MAX_RATIO else "FAIL",
        "memory-activations",
        f"one forward of {rows} x {length} tokens peaked {peak / MiB:.1f} MiB above the weights, planned "
        f"{plan.activation_bytes / MiB:.1f} MiB (x{ratio:.2f}; at most x{ACTIVATIONS_MAX_RATIO})",
    )


# ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.format(
            scale_rtol=SCALE_RTOL,
            min_top1=MIN_TOP1_AGREEMENT,
            weights_rtol=WEIGHTS_RTOL,
            activations_ratio=ACTIVATIONS_MAX_RATIO,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=REPO / "artifacts" / "gpu-check",
        help="where the imported model and both devices' calibrations and exports go (default: artifacts/gpu-check)",
    )
    # --device cpu: a dry run of the same code on CPU against CPU (the FP8 GEMMs too: torch has them on CPU); the
    # memory checks are skipped
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    from pipeline.errors import TargetUnavailable

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False); run this on a "
            "machine with an NVIDIA GPU and a CUDA build of torch",
            file=sys.stderr,
        )
        return TargetUnavailable.exit_code
    try:
        import modelopt.torch.quantization  # noqa: F401
    except ImportError as exc:
        print(f"FAIL setup: nvidia-modelopt cannot be imported ({exc}); pip install -e '.[quant]'")
        return 1

    report = Report()
    with contextlib.redirect_stdout(sys.stderr):  # ModelOpt and transformers print progress: stdout is the checks'
        return run_checks(report, args.output, args.device)


def run_checks(report: Report, output: Path, device: str) -> int:
    from pipeline.validation import load_config

    configs = {path: load_config(path) for path in CONFIGS}
    hf_dir = report.run("import", import_check, list(configs.values()), output)
    if hf_dir is None:
        return 1
    fp8_cfg, fp8 = configs[FP8_CONFIG], None
    fp8_export = report.run(
        f"export/{FP8_CONFIG.stem}", export_check, fp8_cfg, hf_dir, output / FP8_CONFIG.stem, device
    )
    if fp8_export is None:
        report.line("FAIL", "fp8-forward", f"no {device} export of {FP8_CONFIG.name} to run (see its line)")
    else:
        fp8 = report.run("fp8-forward", fp8_forward_check, fp8_cfg, fp8_export, hf_dir, device)
    try:
        memory_checks(report, fp8_cfg, fp8)
    except Exception as exc:
        traceback.print_exc()
        report.line("FAIL", "memory", f"{type(exc).__name__}: {exc}")
    for path in CONFIGS[1:]:  # INT4 AWQ's search is the slowest calibration on CPU: last
        report.run(f"export/{path.stem}", export_check, configs[path], hf_dir, output / path.stem, device)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
