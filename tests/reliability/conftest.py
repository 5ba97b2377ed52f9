"""The serving tests' real tritonserver, for the reliability tests."""

from tests.serving.conftest import server  # noqa: F401
