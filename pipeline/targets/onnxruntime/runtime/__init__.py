"""The onnxruntime target's runtime: the ModelRunner over a built engine, its KV cache, sampling, guides, LoRA slots
and speculative drafts, and the in-flight batching scheduler its Triton model runs."""
