"""What a `docker build` of our Dockerfile takes from a config: the config's path inside the build context (the
Dockerfile copies build_configs/ only) and the command line's overrides, so that a printed command builds, as
printed, the config that was planned."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeline.paths import inside

REPOSITORY = Path(__file__).resolve().parents[1]  # the checkout holding the Dockerfile: the build context
IMAGE_CONFIGS = "build_configs"  # the configs the Dockerfile copies into both images
APP_DIR = "/opt/trtllm-pipeline"  # where both images install the pipeline, in a virtualenv (.venv)
PLAIN_OVERRIDE = re.compile(r"[A-Za-z0-9_.\-]+=[A-Za-z0-9_.,:/+\-\[\]{}]*")  # survives the image's `sh -c` unquoted


@dataclass(frozen=True)
class ImageBuild:
    """A `docker build` command for a config, or why none builds it as planned."""

    command: list[str] | None
    problem: str | None = None

    def shown(self) -> str:
        return shlex.join(self.command) if self.command else f"(no image command: {self.problem})"


def image_build(cfg, target: str | None, tag: str) -> ImageBuild:
    """`docker build` of our Dockerfile's stage `target` (None: the default, last one) for `cfg`, tagged `tag`."""
    if not (REPOSITORY / "Dockerfile").is_file():
        return ImageBuild(None, f"no Dockerfile beside the installed pipeline ({REPOSITORY}): use a checkout of it")
    configs = REPOSITORY / IMAGE_CONFIGS
    if cfg.source is None:
        config = f"{IMAGE_CONFIGS}/CONFIG.yaml"
    elif inside(configs, cfg.source):
        config = cfg.source.resolve().relative_to(REPOSITORY).as_posix()
    else:
        return ImageBuild(
            None,
            f"the image copies only {configs}/, and {cfg.source} is not there: copy it in "
            f"(cp {shlex.quote(str(cfg.source))} {configs}/) and run this command on the copy",
        )
    unplain = [override for override in cfg.overrides if not PLAIN_OVERRIDE.fullmatch(override)]
    if unplain:
        return ImageBuild(
            None,
            f"the image passes overrides to `sh -c` unquoted, and {', '.join(map(shlex.quote, unplain))} would be "
            f"split or expanded there: write them into {config} instead",
        )
    context = os.path.relpath(REPOSITORY)
    command = ["docker", "build", *([f"--target={target}"] if target else []), f"--build-arg=CONFIG={config}"]
    if cfg.overrides:
        command.append(f"--build-arg=OVERRIDES={' '.join(cfg.overrides)}")
    return ImageBuild([*command, f"--tag={tag}", context if not context.startswith("..") else str(REPOSITORY)])
