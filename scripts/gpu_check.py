#!/usr/bin/env python
"""Checks on an NVIDIA GPU what the trtllm target predicts on CPU; needs torch with CUDA and nvidia-modelopt, not
TensorRT-LLM.

  modelopt-container  ModelOpt as the TensorRT-LLM 1.1/1.2 containers ship it (~=0.37, `quant_cfg` a dict; run from
                      --container-modelopt DIR in a Python of its own: scripts/modelopt_container_smoke.py) quantizing
                      a tiny Llama on the GPU with the pipeline's modelopt_config of the FP8 config: the quantizers
                      placed, enabled and calibrated as its quantization section asks. SKIP without DIR.
  export/<config>     ModelOpt calibration of the default model (SmolLM2-135M-Instruct as the pipeline imports it)
                      on the GPU for build_configs/smollm2-135m-fp8.yaml and smollm2-135m-int4-awq.yaml (the
                      pipeline's quantize stage with the GPU as torch's default device), exported by the pipeline's
                      export stage, against the same on CPU: the same files, tensor names, shapes and dtypes, the
                      same JSON files (config.json, hf_quant_config.json), scales within {scale_rtol:.2e} relative.
  fp8-forward         the FP8 checkpoint calibrated on the GPU run with FP8 GEMMs (torch._scaled_mm, as TensorRT-LLM's
                      PyTorch backend loads it) against ModelOpt's fake quant of that calibration in the same dtype on
                      the GPU, over the built-in chat prompts: the mean next-token KL divergence, at most
                      {kl_factor:g}x the fake quant's own spread between float32 and that dtype there (and that spread
                      at most {max_spread}); top-1 agreement reported. SKIP below compute capability 8.9.
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
.venv/bin/python scripts/gpu_check.py [--output DIR] [--container-modelopt DIR]

On the device tool's lent H200 (python3 with torch, but transformers 5.x and no network, ModelOpt or pipeline; 64 MiB
a call), `.venv/bin/python scripts/dev/gpu_check_carry.py` here fills the gitignored .gpu_check/ with what the checks
lack, in two calls' parts (the model's wheel alone is 89 MiB), and prints the calls: the second at once after the
first, as the machine keeps call 1's part only while warm (30 s):
  run(carry=[".gpu_check/call-1"], timeout_s=60, command="ls -l .gpu_check/call-1")
  run(carry=[".gpu_check/call-2"], timeout_s=560, command="bash scripts/dev/gpu_check_device.sh")
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import traceback
from pathlib import Path

import modelopt_container_smoke  # beside this file

REPO = Path(__file__).resolve().parents[1]
FP8_CONFIG = REPO / "build_configs" / "smollm2-135m-fp8.yaml"
CONFIGS = (FP8_CONFIG, REPO / "build_configs" / "smollm2-135m-int4-awq.yaml")
CONTAINER_MODELOPT = REPO / ".gpu_check" / "modelopt-0.37"  # scripts/dev/gpu_check_carry.py puts it there

# Both devices calibrate in float32, but the export derives INT4-AWQ's scales in float16 (the checkpoint dtype),
# where float32 rounding differences between the devices become float16 steps of up to 2^-10 of a value. Measured on
# an H200 (2026-11-26): FP8 scales identical, INT4-AWQ's at most 1.31e-3 apart; a calibration in another dtype or on
# fewer batches moves scales further.
SCALE_RTOL = 2**-9
# fp8-forward: the FP8 GEMMs against ModelOpt's fake quant (the calibrated model, quantizers on) in the same dtype on
# the same device, as the mean over positions of KL(fake quant || FP8 GEMMs) of the next-token distributions. Float16
# alone moves SmolLM2 little; FP8's static per-tensor activation scales do (the calibrated maxima are large, layer 11's
# down_proj inputs reach 3,188, so most values sit on coarse FP8 steps), and any perturbation of float16's size moves
# some values across an FP8 rounding boundary, which 30 layers amplify into a divergence of about one level whatever the
# perturbation. Measured on CPU (2026-11-28, torch 2.13.0+cpu, ModelOpt 0.47.0; this config calibrated and exported
# on CPU, the models as this check builds them (`scripts/gpu_check.py --device cpu`), over the 30 chat prompts, 1,296
# positions; the first row is the unquantized import, the last three edit fp8_model's buffers):
#   SmolLM2 unquantized, float16 from float32                      KL 3.6e-05  top-1 1.000 (float16 alone flips none)
#   fake quant, float16 from float32: the spread                   KL 0.074    top-1 0.846
#   FP8 GEMMs (torch._scaled_mm) from fake quant, both float16     KL 0.088    top-1 0.900 (1.19x the spread)
#   ... every input scale doubled                                  KL 0.078    (FP8 is floating point: a uniform scale
#                                                                               moves only subnormals and the clamp)
#   ... without the FP8 KV cache's rounding of k and v             KL 0.083
#   ... one linear's weight scale doubled (layers.10.mlp.down_proj) KL 0.362   top-1 0.726 (4.9x the spread)
# So the spread is measured in each run, on the device, and the FP8 GEMMs fail beyond KL_SPREAD_FACTOR times it: a
# wrong scale, layout or GEMM, not rounding. Top-1 agreement is reported, not gated: at SmolLM2's flat logits it counts
# the same boundary flips (0.846 for float16 alone). The old gate (top-1 against the CPU float32 reference, 0.85 after
# one H200 run at 0.894, "float16 alone flips about a tenth of the top-1s") mistook FP8's flips for float16's.
KL_SPREAD_FACTOR = 2.0
# A spread beyond 4x the CPU measurement means the fake quant misbehaves in float16 there; it would raise the bound.
MAX_SPREAD = 0.3
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


# ---------------------------------------------------------------- 2. FP8 GEMMs against ModelOpt's fake quant


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


def next_token_divergence(expected, got):
    """Per position of one sequence's logits [positions, vocab]: KL(P || Q) of the next-token distributions P =
    softmax(expected) and Q = softmax(got), in float64, and whether their top-1 tokens agree."""
    import torch

    p, q = torch.log_softmax(expected.double(), -1), torch.log_softmax(got.double(), -1)
    return (p.exp() * (p - q)).sum(-1), p.argmax(-1) == q.argmax(-1)


def fp8_verdict(kl: float, spread: float) -> tuple[str, str]:
    """fp8-forward's status and why, from the FP8 GEMMs' mean KL from ModelOpt's fake quant in the same dtype and the
    spread of that fake quant between float32 and that dtype (KL_SPREAD_FACTOR says why)."""
    bound = KL_SPREAD_FACTOR * spread
    if not (math.isfinite(kl) and math.isfinite(spread)):
        return "FAIL", "a divergence is not finite"
    if spread > MAX_SPREAD:
        return "FAIL", f"the float16 spread is beyond {MAX_SPREAD}: the fake quant itself misbehaves there"
    if kl > bound:
        return "FAIL", f"the FP8 GEMMs diverge beyond {KL_SPREAD_FACTOR:g}x the spread ({bound:.3e})"
    return "PASS", f"within {KL_SPREAD_FACTOR:g}x the spread ({bound:.3e})"


def with_dtype(model, dtype, device: str):
    """A copy of ModelOpt's calibrated `model` on `device` with its parameters in `dtype`; its buffers (the
    quantizers' amax, RoPE's frequencies) stay float32, as calibration and transformers keep them."""
    import copy

    copied = copy.deepcopy(model)
    for parameter in copied.parameters():
        parameter.data = parameter.data.to(dtype)
    return copied.to(device).eval()


def fp8_forward_check(cfg, export_dir: Path, hf_dir: Path, device: str):
    """Check 2; its result is (the FP8 model on `device`, the bytes the allocator gave it), None when skipped."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.quality import chat_prompts
    from pipeline.targets.trtllm.modelopt import load_calibrated
    from pipeline.targets.trtllm.reference import load_unified_reference

    cuda = device == "cuda"
    if cuda and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        capability = "{}.{}".format(*torch.cuda.get_device_capability())
        return "SKIP", f"{torch.cuda.get_device_name()} has compute capability {capability}; FP8 GEMMs need 8.9", None
    unified_dir = export_dir / "hf_unified"
    log(f"fp8-forward: the FP8 GEMM model of {unified_dir} and ModelOpt's fake quant of {export_dir.parent}")
    reference = load_unified_reference(unified_dir, hf_dir, cfg.target.trtllm_version)
    before = torch.cuda.memory_allocated() if cuda else 0
    model = fp8_model(reference, unified_dir, cfg.target.trtllm_version, device)
    held = torch.cuda.memory_allocated() - before if cuda else None
    dtype = model.dtype  # the checkpoint's, as TensorRT-LLM computes
    calibrated = load_calibrated(hf_dir, export_dir.parent / "quantize")
    runs = {  # ModelOpt's fake quant: the calibrated model with its quantizers on
        "fake": with_dtype(calibrated, dtype, device),
        "fake32": with_dtype(calibrated, torch.float32, device),
        "export": on_device(reference, dtype, device),  # the export as the backend loads it, without FP8 GEMMs
    }
    del calibrated
    prompts = chat_prompts(AutoTokenizer.from_pretrained(hf_dir))
    pairs = {"fp8": ("fake", "fp8"), "spread": ("fake32", "fake"), "export": ("export", "fp8")}
    kl, top1 = dict.fromkeys(pairs, 0.0), dict.fromkeys(pairs, 0)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            logits = {name: run(ids).logits[0] for name, run in runs.items()} | {"fp8": model(ids).logits[0]}
            for pair, (expected, got) in pairs.items():
                divergence, agree = next_token_divergence(logits[expected], logits[got])
                kl[pair] += float(divergence.sum())
                top1[pair] += int(agree.sum())
    del runs
    positions = sum(map(len, prompts))
    kl, top1 = {k: v / positions for k, v in kl.items()}, {k: v / positions for k, v in top1.items()}
    status, why = fp8_verdict(kl["fp8"], kl["spread"])
    name = str(dtype).removeprefix("torch.")
    text = (
        f"{len(prompts)} chat prompts, {positions:,} positions on {device}, mean next-token KL divergence: FP8 GEMMs "
        f"from ModelOpt's fake quant, both {name}, {kl['fp8']:.3e} (top-1 agreement {top1['fp8']:.4f}); the fake "
        f"quant's spread, {name} from float32, {kl['spread']:.3e} (top-1 {top1['spread']:.4f}): {why}; the FP8 "
        f"GEMMs from the export as the backend loads it, in {name} without FP8 GEMMs, {kl['export']:.3e} (top-1 "
        f"{top1['export']:.4f})"
    )
    return status, text, (model, held)


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
            kl_factor=KL_SPREAD_FACTOR,
            max_spread=MAX_SPREAD,
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
    parser.add_argument(
        "--container-modelopt",
        type=Path,
        default=CONTAINER_MODELOPT,
        help="a directory holding the containers' ModelOpt, unpacked, for modelopt-container (default: "
        ".gpu_check/modelopt-0.37)",
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
        print(
            f"FAIL setup: nvidia-modelopt cannot be imported ({exc}); pip install -e '.[quant]', or put the one "
            "scripts/dev/gpu_check_carry.py unpacks (.gpu_check/modelopt-0.47) on PYTHONPATH"
        )
        return 1

    report = Report()
    with contextlib.redirect_stdout(sys.stderr):  # ModelOpt and transformers print progress: stdout is the checks'
        return run_checks(report, args.output, args.device, args.container_modelopt)


def run_checks(report: Report, output: Path, device: str, container_modelopt: Path) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import modelopt

    from pipeline.validation import load_config

    log(f"ModelOpt {modelopt.__version__} ({Path(modelopt.__file__).parent}) calibrates and exports")
    configs = {path: load_config(path) for path in CONFIGS}
    with ThreadPoolExecutor(1) as pool:  # its Python of its own runs beside the import (20 s saved)
        smoke = pool.submit(modelopt_container_smoke.check, container_modelopt, device)
        hf_dir = report.run("import", import_check, list(configs.values()), output)
        report.run(modelopt_container_smoke.NAME, smoke.result)
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
