"""Names from the config that become paths: a Triton model name is a directory of the output.

One rule for what a model name may be (checked when the config loads and when a repository is
validated) and one check that a path stays under its root, which every writer joining such a name
asserts before writing anything.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import shown

# One path component that is also a plain URL segment (/v2/models/<name>/...): no separators, no
# '.'/'..', no hidden directory, nothing a shell or URL would need quoted.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot name a Triton model (a directory of the repository), or None when it can."""
    if MODEL_NAME.fullmatch(name):
        return None
    return (
        f"{shown(name)} is not a valid Triton model name (it names a directory of the repository): use 1 to 128 "
        "letters, digits, '_', '-' or '.', starting with a letter, digit or '_'"
    )


def inside(root: Path, path: Path) -> bool:
    """Whether `path` lies below `root` (not at it) once '..' and symlinks are resolved."""
    return root.resolve() in path.resolve().parents
