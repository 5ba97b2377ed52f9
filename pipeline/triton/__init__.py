"""Triton Inference Server: repository generation, offline validation and serving."""
