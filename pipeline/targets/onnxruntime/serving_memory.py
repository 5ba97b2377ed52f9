"""Host memory of one onnxruntime server at its worst (`deploy`: the Kubernetes memory request)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.memory import MiB, parameter_counts

# What the serving processes of an onnxruntime build hold besides the engine (PSS, which counts a shared page once
# across processes, as a container's memory cgroup does), measured on the default config's idle server (`serve
# --openai`, 2026-11-24, 1,494 MiB in all): the `serve` process with the OpenAI gateway, tritonserver, one
# tokenizer model instance (pre- or postprocessing: python stub, transformers, the tokenizer), one BLS instance, and
# the LLM model instance's runtime (stub, onnxruntime, the scheduler) without its weights and KV cache.
CPU_SERVE_PROCESS_BYTES = 330 * MiB
CPU_TRITONSERVER_BYTES = 37 * MiB
CPU_TOKENIZER_INSTANCE_BYTES = 293 * MiB
CPU_BLS_INSTANCE_BYTES = 21 * MiB
CPU_LLM_RUNTIME_BYTES = 270 * MiB


def matmul_nbits_bytes_per_param(weights: str, group_size: int) -> float:
    """MatMulNBits: packed weights plus one float32 scale per block (int4 adds a 4-bit zero point per block)."""
    return {"none": 4.0, "int8": 1 + 4 / group_size, "int4": 0.5 + 4.5 / group_size}[weights]


def engine_weight_bytes(quantization, facts) -> int:
    """The weights of an onnxruntime engine (MatMulNBits); the lm_head is a quantized linear, tied or not."""
    linear, embedding = parameter_counts(facts)
    per_param = matmul_nbits_bytes_per_param(quantization.weights, quantization.group_size)
    table = embedding * (per_param if quantization.quantize_embedding else 4.0)
    return int((linear + embedding) * per_param + table)


@dataclass
class HostMemoryPlan:
    """Host memory of one onnxruntime server at its worst: every row at max_seq_len and the prefix store full."""

    weights_bytes: int
    kv_rows_bytes: int  # every running row's contiguous KV buffer at max_seq_len
    kv_store_bytes: int  # the prefix store filled to the pool (enable_kv_cache_reuse)
    activation_bytes: int
    runtime_bytes: int  # the processes' own memory (measured constants above)
    llm_instances: int

    @property
    def total_bytes(self) -> int:
        per_instance = self.weights_bytes + self.kv_rows_bytes + self.kv_store_bytes + self.activation_bytes
        return self.runtime_bytes + self.llm_instances * per_instance

    def lines(self) -> list[str]:
        m = lambda b: f"{b / MiB:,.0f} MiB"  # noqa: E731
        return [
            f"host memory per replica {m(self.total_bytes)}: {self.llm_instances} x (weights {m(self.weights_bytes)} "
            f"+ KV rows {m(self.kv_rows_bytes)} + prefix store {m(self.kv_store_bytes)} + activations "
            f"{m(self.activation_bytes)}) + processes {m(self.runtime_bytes)}"
        ]


def plan_cpu_serving(cfg, facts) -> HostMemoryPlan:
    """The worst case of one onnxruntime replica serving `cfg` (its runtime keeps KV rows and store in float32)."""
    q, b, r, t = cfg.quantization, cfg.build, cfg.runtime, cfg.triton
    weights = engine_weight_bytes(q, facts)
    kv_per_token = facts.num_hidden_layers * 2 * facts.num_key_value_heads * facts.head_size * 4
    pool = r.max_tokens_in_paged_kv_cache or b.max_batch_size * b.max_seq_len
    activations = b.max_num_tokens * (4 * facts.hidden_size + 3 * facts.intermediate_size) * 4
    runtime = (
        CPU_SERVE_PROCESS_BYTES
        + CPU_TRITONSERVER_BYTES
        + CPU_TOKENIZER_INSTANCE_BYTES * (t.preprocessing_instance_count + t.postprocessing_instance_count)
        + CPU_BLS_INSTANCE_BYTES * t.bls_instance_count
        + CPU_LLM_RUNTIME_BYTES * t.llm_instance_count
    )
    return HostMemoryPlan(
        weights_bytes=weights,
        kv_rows_bytes=b.max_batch_size * b.max_seq_len * kv_per_token,
        kv_store_bytes=pool * kv_per_token if r.enable_kv_cache_reuse else 0,
        activation_bytes=int(activations),
        runtime_bytes=runtime,
        llm_instances=t.llm_instance_count,
    )
