"""NaN and infinities in weights and logits, named where they are first found: a build stops on them by name
(the import on a damaged checkpoint, the quality gate on logits), instead of scoring or serving garbage."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def nonfinite(values: np.ndarray) -> tuple[str, tuple[int, ...], int] | None:
    """(NaN, inf or -inf, the index of the first such value, how many values are not finite) for an array holding
    any; None when every value is finite (integers always are)."""
    if values.dtype.kind not in "fc":
        return None
    finite = np.isfinite(values)
    if finite.all():
        return None
    index = np.unravel_index(int(np.argmin(finite)), values.shape)
    value = values[index]
    kind = "NaN" if np.isnan(value) else "inf" if value > 0 else "-inf"
    return kind, tuple(int(i) for i in index), int(values.size - np.count_nonzero(finite))


def nonfinite_tensor(name: str, values: np.ndarray) -> str | None:
    """The message `<name> holds NaN (first at [0, 3]; 1 of 64 values not finite)` for an array holding NaN or inf."""
    found = nonfinite(values)
    return (
        found and f"{name} holds {found[0]} (first at {list(found[1])}; {found[2]} of {values.size} values not finite)"
    )


def nonfinite_weight(hf_dir: Path) -> str | None:
    """`nonfinite_tensor` of the first tensor of the checkpoint's *.safetensors holding NaN or an infinity, after its
    file; read one tensor at a time. Logits do not always show such a weight: transformers' default SDPA attention on
    CPU (torch 2.13) gave finite logits from a q_proj weight holding NaN, eager attention NaN ones."""
    from safetensors import safe_open

    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and (problem := nonfinite_tensor(name, tensor.float().numpy())):
                    return f"{file}: {problem}"
    return None
