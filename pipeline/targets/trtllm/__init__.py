"""The `trtllm` target (GPU): everything this pipeline knows of TensorRT-LLM, checked against each release's facts.

adapter: the Target; backend: the two backends' protocol and registry (tensorrt_backend: trtllm-build and Triton's
C++ backend; pytorch_backend: the PyTorch backend's LLM-API options, llm_api_serving: running and serving them);
modelopt: calibration and checkpoint export; prequantized: already-quantized checkpoints; guided: structured outputs
on the C++ backend; checkpoint, torch_checkpoint: conformance to what a release's loaders read; reference: the CPU
quality forward; llm_api_options, triton_llmapi_model, triton_cpp_backend: readers of the tabulated upstream facts;
repo_checks: its models' checks in any Triton repository; triton_launch: the container's tritonserver ranks;
gpu_memory: the GPU memory plan; lora_conversion: adapters as each release takes them; deployment: Kubernetes; image:
our GPU image's Dockerfile stage per release, image_check: the check that image runs while it is built.
"""
