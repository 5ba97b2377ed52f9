"""The `onnxruntime` target (CPU): the adapter, our fused ONNX Runtime graph, and how its repository is served."""
