"""Preflight memory plan for a TensorRT-LLM build: does it fit the target GPU, and how much KV cache is left.

Estimates, per GPU (the busiest rank): weights by quantization, activations and workspace for
`max_num_tokens`, the CUDA context, the PyTorch backend's CUDA graph pool (its graphs share one pool, sized by
the largest captured decode batch), then the KV cache per token and how many tokens and full-length
sequences fit in `kv_cache_free_gpu_mem_fraction` of what remains. Estimates, not measurements: they err
on the safe side so that a refused config would really not fit. The host memory each build stage needs is
`pipeline.host_memory`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.memory import DTYPE_BYTES, GPUS, GiB, parameter_counts

CUDA_CONTEXT_BYTES = int(1.5 * GiB)  # context, cuBLAS/TensorRT workspace, runtime buffers


def weight_bytes_per_param(weights: str, group_size: int, dtype_bytes: int) -> float:
    """A TensorRT-LLM checkpoint's bytes per linear parameter in each weight format, its scales included."""
    return {"none": dtype_bytes, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / group_size, "nvfp4": 0.5 + 1 / 16}[weights]


@dataclass
class MemoryPlan:
    gpu: str
    gpu_bytes: int
    weights_bytes: int  # per GPU, busiest rank
    activation_bytes: int
    context_bytes: int
    cuda_graph_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    kv_tokens: int
    full_sequences: int
    problems: list[str]

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return [
            f"target GPU {self.gpu}: {g(self.gpu_bytes)} per GPU",
            f"weights per GPU {g(self.weights_bytes)}, activations/workspace {g(self.activation_bytes)}, CUDA "
            f"context {g(self.context_bytes)}"
            + (f", CUDA graph pool {g(self.cuda_graph_bytes)}" if self.cuda_graph_bytes else ""),
            f"KV cache: {self.kv_bytes_per_token / 1024:.1f} KiB per token; {g(self.kv_budget_bytes)} -> "
            f"{self.kv_tokens:,} tokens, "
            f"{self.full_sequences:,} full-length sequences",
        ]


def rank_weight_bytes(cfg, facts) -> int:
    """Weights of the busiest rank: its share of the layers, plus the embedding (first stage) or lm_head (last);
    both when pp == 1 (the tables stay in the model dtype)."""
    q, tp, pp = cfg.quantization, cfg.parallel.tp_size, cfg.parallel.pp_size
    dtype_bytes = DTYPE_BYTES.get(cfg.model.dtype, 2)
    linear, embedding = parameter_counts(facts)
    layers_bytes = linear / (tp * pp) * weight_bytes_per_param(q.weights, q.group_size, dtype_bytes)
    return int(layers_bytes + (2 if pp == 1 else 1) * embedding / tp * dtype_bytes)


# Host memory of one TensorRT-LLM rank besides its weights (python, CUDA and NCCL host state; an estimate, not
# measured: no GPU here). Loading stages a rank's weights through host memory, so the weights count once more.
GPU_RANK_HOST_BYTES = 4 * GiB


def gpu_pod_host_bytes(cfg, facts, ranks: int) -> int:
    """Host memory of a pod running `ranks` TensorRT-LLM ranks while they load."""
    return ranks * (rank_weight_bytes(cfg, facts) + GPU_RANK_HOST_BYTES)


def plan_memory(cfg, facts, cuda_graph_batch: int = 0) -> MemoryPlan:
    """The plan for `cfg` on `target.gpu`; `cuda_graph_batch` is the largest decode batch captured as a CUDA graph
    in a pool of its own (the PyTorch backend's; engines capture inside their activation workspace)."""
    q, b, p, r = cfg.quantization, cfg.build, cfg.parallel, cfg.runtime
    dtype_bytes = DTYPE_BYTES.get(cfg.model.dtype, 2)  # auto exports float16
    tp, pp = p.tp_size, p.pp_size
    weights = rank_weight_bytes(cfg, facts)
    activations = int(
        b.max_num_tokens * (4 * facts.hidden_size + 2 * facts.intermediate_size / tp) * dtype_bytes
        + b.max_batch_size * b.max_beam_width * facts.vocab_size * 4
    )
    # one decode step of the largest captured batch: its hidden states, MLP intermediates and float32 logits
    graphs = int(
        cuda_graph_batch
        * b.max_beam_width
        * ((4 * facts.hidden_size + 2 * facts.intermediate_size / tp) * dtype_bytes + facts.vocab_size * 4)
    )
    kv_dtype_bytes = 1 if q.kv_cache in ("fp8", "int8") else dtype_bytes
    kv_heads_per_rank = max(1, facts.num_key_value_heads // tp)
    kv_per_token = math.ceil(facts.num_hidden_layers / pp) * kv_heads_per_rank * facts.head_size * 2 * kv_dtype_bytes
    gpu = cfg.target.gpu
    total = GPUS[gpu] * GiB
    free = total - weights - activations - CUDA_CONTEXT_BYTES - graphs
    budget = max(0, int(free * r.kv_cache_free_gpu_mem_fraction))
    tokens = budget // kv_per_token
    plan = MemoryPlan(
        gpu,
        total,
        weights,
        activations,
        CUDA_CONTEXT_BYTES,
        graphs,
        kv_per_token,
        budget,
        tokens,
        tokens // b.max_seq_len,
        [],
    )
    if free <= 0:
        plan.problems.append(
            f"does not fit one {gpu} ({GPUS[gpu]} GiB): weights {weights / GiB:.1f} GiB + activations "
            f"{activations / GiB:.1f} GiB + CUDA context {CUDA_CONTEXT_BYTES / GiB:.1f} GiB"
            + (f" + CUDA graph pool {graphs / GiB:.1f} GiB" if graphs else "")
            + " per GPU; quantize "
            "(fp8/int4), raise parallel.tp_size, or choose a larger GPU"
        )
    elif tokens < b.max_seq_len:
        plan.problems.append(
            f"leaves KV cache for {tokens:,} tokens on a {gpu}, less than one sequence of max_seq_len "
            f"{b.max_seq_len}; lower max_num_tokens or max_seq_len, quantize the KV cache, or raise tp_size"
        )
    return plan
