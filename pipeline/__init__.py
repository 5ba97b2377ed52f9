"""trtllm-pipeline: compile Hugging Face LLM checkpoints into engines and Triton model repositories."""

__version__ = "0.1.0"
