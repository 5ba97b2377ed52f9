"""The `onnxruntime` target (CPU): the adapter, our fused ONNX Runtime graph, its weight quantization, and how its
repository is served."""

ONNX_NAME = "model.onnx"  # the graph file of an export and of an engine
