"""Benchmarks users can trust: offline (ModelRunner vs transformers) and serving (load against Triton),
with raw samples, percentiles, goodput, reports and side-by-side comparisons."""
