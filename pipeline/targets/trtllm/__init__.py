"""The `trtllm` target (GPU): everything this pipeline knows of TensorRT-LLM, checked against each release's facts.

adapter: the Target; backend/backends: the two backends' protocol and registry (engine: trtllm-build and Triton's
C++ backend; llmapi: the PyTorch backend's LLM-API options); modelopt: calibration and checkpoint export;
checkpoint, torch_checkpoint: conformance to what a release's loaders read; reference: the CPU quality forward;
llm_api_args, llmapi_model, tensorrtllm_backend: readers of the tabulated upstream facts; serving: deployment;
image: our GPU image's Dockerfile stage per release, image_check: the check that image runs while it is built.
"""
