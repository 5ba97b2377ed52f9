"""The OpenAI-compatible serving tier in front of tritonserver."""
