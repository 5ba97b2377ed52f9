"""GPTQ for the onnxruntime target's int4 engines: each linear's weights rounded one input row at a time, the
rounding error of each row spread over the rows not yet rounded through the inverse Hessian of the layer's inputs
(Frantar et al. 2022, arXiv:2210.17323, Algorithm 1, with its lazy blocks and grouped scales).

Written here rather than taken from a library, because none runs here and gives integer codes an engine can hold:
ONNX Runtime 1.32's GPTQWeightOnlyQuantConfig (onnxruntime/quantization/neural_compressor/weight_only.py `gptq`)
reads the error-feedback row of its transposed, upper-triangular inverse Hessian as a column (`Hinv1[i:, i]`), which
is zero below the diagonal, so its result equals round-to-nearest on the same grid (tests/targets/test_gptq.py shows
it), and it runs the whole model once per matmul input; GPTQModel 7 and llm-compressor 0.14 need transformers 5 and
numpy 2. `quantize` follows the reference's choices step for step (each group's scale and zero from its weights as
updated by earlier lazy blocks, dead inputs zeroed, dampening on the mean diagonal, act-order by the diagonal).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.prequantized import QuantizedLinear
from pipeline.targets.onnxruntime.graph import FUSED_LINEARS, fused_parts

LAZY_BLOCK = 128  # columns rounded before the error reaches the rest of the matrix (the reference's blocksize)


def input_hessians(model, batches, modules: dict[str, str]) -> dict[str, np.ndarray]:
    """{key: 2/n * sum x^T x} over the calibration batches, x the n input rows of the HF module each key names in
    `modules` (key -> module name); accumulated in float32, as GPTQModel does. The decoder runs without the output
    head (whose vocabulary-wide product took most of a forward): the head's input is the decoder's output."""
    import torch

    sums: dict[str, torch.Tensor] = {}
    rows = dict.fromkeys(modules, 0)
    named = dict(model.named_modules())
    head = model.get_output_embeddings()

    def accumulate(key: str, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        sums[key] = sums.get(key, 0) + x.T @ x
        rows[key] += x.shape[0]

    at_head = [key for key, module in modules.items() if named[module] is head]
    handles = [
        named[module].register_forward_pre_hook(lambda _m, args, key=key: accumulate(key, args[0]))
        for key, module in modules.items()
        if key not in at_head
    ]
    try:
        with torch.inference_mode():
            for batch in batches:
                hidden = model.get_decoder()(batch).last_hidden_state
                for key in at_head:
                    accumulate(key, hidden)
    finally:
        for handle in handles:
            handle.remove()
    return {key: (2.0 / rows[key] * total.double()).numpy() for key, total in sums.items()}


def calibrated_linears(hf_dir: Path, q, options, text: str, progress, skipped: Callable[[str], bool]) -> dict:
    """HF module -> GPTQ's int4 codes for every linear the graph quantizes (graph matmuls `skipped` says to leave
    out are not computed), calibrated on `text` as `q.calibration` says, with GPTQ's `options` (GptqSection)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.fetch import calibration_windows

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    matmuls = {fused_name(name) for name in linears}
    matmuls = {m: fused_parts(m) if all(p in linears for p in fused_parts(m)) else [m] for m in matmuls}
    matmuls = {m: parts for m, parts in sorted(matmuls.items()) if not skipped(m)}
    calibration = q.calibration
    windows = calibration_windows(tokenizer, text, calibration.num_samples, calibration.seq_len)
    hessians = input_hessians(
        model,
        progress(windows, "GPTQ: collecting each layer's input statistics"),
        {m: parts[0] for m, parts in matmuls.items()},
    )
    out = {}
    for module, parts in progress(list(matmuls.items()), "GPTQ: rounding each linear"):
        weight = torch.cat([linears[p].weight.detach() for p in parts]).numpy()
        whole = quantize(
            weight,
            hessians[module],
            bits=4,
            group_size=q.group_size,
            sym=options.sym,
            damp_percent=options.damp_percent,
            desc_act=options.desc_act,
        )
        start = 0
        for part in parts:
            end = start + linears[part].out_features
            out[part] = replace(
                whole, codes=whole.codes[start:end], scales=whole.scales[start:end], zeros=whole.zeros[start:end]
            )
            start = end
    return out


def fused_name(module: str) -> str:
    """The graph matmul an HF linear is part of: 'model.layers.0.self_attn.k_proj' -> '...self_attn.qkv_proj'."""
    prefix, _, leaf = module.rpartition(".")
    fused = next((name for name, parts in FUSED_LINEARS.items() if leaf in parts), leaf)
    return f"{prefix}.{fused}" if prefix else fused


def grid(x, bits: int, sym: bool):
    """Scale and zero point per output row of the group `x` [out, rows] (the reference Quantizer, per channel)."""
    import torch

    maxq = 2**bits - 1
    xmin = torch.clamp(x.min(1).values, max=0)
    xmax = torch.clamp(x.max(1).values, min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    flat = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def quantize(
    weight: np.ndarray,
    hessian: np.ndarray,
    *,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = False,
    damp_percent: float = 0.01,
    desc_act: bool = False,
) -> QuantizedLinear:
    """GPTQ of `weight` [out, in] (float32) against the Hessian of its inputs [in, in]."""
    import torch

    W = torch.tensor(weight, dtype=torch.float32)
    H = torch.tensor(hessian, dtype=torch.float32)
    columns = W.shape[1]
    size = columns if group_size == -1 else group_size
    maxq = 2**bits - 1
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if desc_act else torch.arange(columns)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(columns, dtype=torch.float32)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros_like(W, dtype=torch.uint8)
    groups = -(-columns // size)
    scales = torch.zeros(W.shape[0], groups, dtype=torch.float32)
    zeros = torch.zeros(W.shape[0], groups)
    for i1 in range(0, columns, LAZY_BLOCK):
        i2 = min(i1 + LAZY_BLOCK, columns)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            column = i1 + i
            if column % size == 0:
                scale, zero = grid(W[:, column : column + size], bits, sym)
                scales[:, column // size], zeros[:, column // size] = scale, zero
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            codes[:, column] = q.to(torch.uint8)
            err = (w - scale * (q - zero)) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    restored = torch.empty_like(codes)
    restored[:, perm] = codes  # rows back in the checkpoint's order; g_idx says each one's group
    g_idx = torch.empty(columns, dtype=torch.int32)
    g_idx[perm] = torch.arange(columns, dtype=torch.int32) // size
    return QuantizedLinear(
        codes=restored.numpy(),
        scales=scales.numpy(),
        zeros=zeros.to(torch.uint8).numpy(),
        g_idx=g_idx.numpy() if desc_act else None,
        bits=bits,
        group_size=group_size,
    )
