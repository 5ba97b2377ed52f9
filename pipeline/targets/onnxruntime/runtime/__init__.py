"""Runtimes that execute built engines (the CPU ModelRunner)."""
