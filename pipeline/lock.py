"""The build manifest `build.lock.json`: what each stage read, what it wrote, and with which tools.

Like DVC's lock file: content hashes of inputs and outputs, written atomically with sorted keys.
File hashes are cached by (size, mtime_ns), so checking an unchanged multi-GB engine costs a stat.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

LOCK_NAME = "build.lock.json"
LOCK_FORMAT = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_record(path: Path, cached: dict | None = None) -> dict:
    """{size, mtime_ns, sha256}; reuses the cached sha256 when size and mtime are unchanged."""
    st = path.stat()
    if cached and cached.get("size") == st.st_size and cached.get("mtime_ns") == st.st_mtime_ns:
        return cached
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def hash_paths(paths: list[Path], cached: dict | None = None, root: Path | None = None) -> tuple[dict, str]:
    """Records for every file under `paths` (files or directories) and one hash over their contents.

    Keys are relative to `root` when given, so a moved output directory keeps its hash.
    """
    cached = cached or {}
    records = {}
    for base in paths:
        # __pycache__: the Triton python backend compiles the repository's modules where they lie
        files = (
            sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            if base.is_dir()
            else [base]
        )
        for file in files:
            key = str(file.relative_to(root)) if root else str(file)
            records[key] = file_record(file, cached.get(key))
    return records, sha256_json({k: v["sha256"] for k, v in records.items()})


def read_lock(output: Path) -> dict:
    path = output / LOCK_NAME
    if not path.exists():
        return {"format": LOCK_FORMAT, "stages": {}}
    try:
        lock = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"format": LOCK_FORMAT, "stages": {}}  # a corrupt lock trusts nothing: every stage re-runs
    return lock if lock.get("format") == LOCK_FORMAT else {"format": LOCK_FORMAT, "stages": {}}


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def write_json_atomic(path: Path, value) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over the target."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_lock(output: Path, lock: dict) -> None:
    write_json_atomic(output / LOCK_NAME, lock)


def remove_lock_temps(output: Path) -> None:
    """Delete the temporary files of lock writes killed before their rename (SIGKILL skips the cleanup).
    Only while holding the build lock: then no writer is alive."""
    for stale in output.glob(_temp_prefix(output / LOCK_NAME) + "*"):
        stale.unlink(missing_ok=True)
