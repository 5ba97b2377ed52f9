"""Triton `ModelConfig` protobufs for one model directory: what target adapters and the repository writer share.

A leaf module (it imports only the tensor tables of `interface`), so a target can describe its LLM model without
importing the repository writer that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from pipeline.triton import interface

MODELS_DIR = Path(__file__).parent / "models"


@dataclass
class ModelSpec:
    """One model directory: its config and the files of its version directory `1/`."""

    config: mc.ModelConfig
    files: dict[str, Path] = field(default_factory=dict)  # name in 1/ -> source file
    texts: dict[str, str] = field(default_factory=dict)  # name in 1/ -> generated content (e.g. model.yaml)


def tensors(cls, table: list[interface.Tensor]) -> list:
    out = []
    for name, dtype, dims, optional in table:
        tensor = cls(name=name, data_type=mc.DataType.Value(dtype), dims=dims)
        if optional and cls is mc.ModelInput:
            tensor.optional = True
        out.append(tensor)
    return out


def model_config(
    name: str,
    *,
    max_batch_size: int,
    inputs,
    outputs,
    backend: str = "python",
    platform: str = "",
    parameters: dict[str, object] | None = None,
    instances: int = 1,
    decoupled: bool = False,
    queue_delay_us: int = 0,
    max_queue_size: int = 0,
) -> mc.ModelConfig:
    config = mc.ModelConfig(
        name=name,
        backend=backend,
        platform=platform,
        max_batch_size=max_batch_size,
        input=tensors(mc.ModelInput, inputs),
        output=tensors(mc.ModelOutput, outputs),
    )
    if platform != "ensemble":
        config.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        if max_queue_size:
            config.dynamic_batching.default_queue_policy.max_queue_size = max_queue_size
    if decoupled:
        config.model_transaction_policy.decoupled = True
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return config
