"""The safetensors header reader every streaming stage relies on (`pipeline.safetensors_files`), on files written
by the safetensors library itself."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.safetensors_files import read_header, tensor_headers


def test_headers_are_read_without_the_data_and_a_truncated_or_padded_file_is_refused(tmp_path):
    save_file({"w": np.ones((4, 8), np.float16), "b": np.zeros(3, np.int32)}, tmp_path / "a.safetensors")
    assert tensor_headers(tmp_path) == {"w": ("F16", [4, 8]), "b": ("I32", [3])}
    whole = (tmp_path / "a.safetensors").read_bytes()
    for damaged in (whole[:-2], whole + b"\0\0"):  # safetensors refuses both: "file not fully covered"
        (tmp_path / "a.safetensors").write_bytes(damaged)
        with pytest.raises(ValueError, match="truncated"):
            read_header(tmp_path / "a.safetensors")
