"""Our GPU image: one Dockerfile stage per TensorRT-LLM release, written from the facts of NVIDIA's Triton container
holding that release (upstream/triton_trtllm_images.json: its tag and versions from Triton's compatibility matrix, its
Python layout from tensorrtllm_backend's Dockerfile on that container's branch).

The container's TensorRT-LLM, torch, ModelOpt and (where its TensorRT-LLM requires it) transformers stay exactly as
NVIDIA built them; the pipeline gets a virtualenv that sees them after its own packages. Where the container keeps
its packages in the system's site-packages, `--system-site-packages` is enough. In 1.2's container they live in a
virtualenv placed first on PATH, and a virtualenv made from another one sees only the base interpreter's
site-packages: ours is made from the base interpreter and adds the container's site-packages through a `.pth` file
that calls `site.addsitedir`, so that the `.pth` files in it are processed too (a bare path line would add the
directory only). `image_check.py` proves both while the image is built, checks that the container's ModelOpt is the
one its TensorRT-LLM pins, and runs a real ModelOpt quantization of a tiny model with the config's quantization, so
that a ModelOpt API our quantize stage does not write for fails the image build, not the container's first build.

The root Dockerfile holds these stages between two marker lines; scripts/dev/render_dockerfile.py rewrites them and
tests/targets/test_gpu_image.py checks that they are current.
"""

from __future__ import annotations

from pipeline.docker import APP_DIR, IMAGE_CONFIGS, ImageBuild, image_build
from pipeline.upstream import release_facts, releases

DEFAULT_RELEASE = "1.2"  # the release of the Dockerfile's `gpu` stage and of the shipped trtllm configs
DEFAULT_CONFIG = f"{IMAGE_CONFIGS}/smollm2-135m-fp8.yaml"  # built into the default stage without --build-arg=CONFIG
CHECK = "pipeline/targets/trtllm/image_check.py"
RECORD_DIR = "/tmp/container-python"
PTH = "container-packages.pth"
BEGIN = "# ---- GPU stages, one per TensorRT-LLM release: written by scripts/dev/render_dockerfile.py; do not edit ----"
END = "# ---- end of the GPU stages ----"


def container(release: str) -> dict:
    """The facts of NVIDIA's container for `release`: tag, versions, Python layout."""
    return release_facts("triton_trtllm_images", release, "NVIDIA's Triton TensorRT-LLM container")


def stage_name(release: str) -> str:
    return f"gpu-{release}"


def image_tag(release: str) -> str:
    return f"trtllm-pipeline:gpu-{release}"


def gpu_image_build(cfg) -> ImageBuild:
    """`docker build` of the stage for the config's release, on the container holding it."""
    release = cfg.target.trtllm_version
    conflict = transformers_conflict(release)
    if conflict:
        return ImageBuild(None, conflict)
    return image_build(cfg, stage_name(release), image_tag(release))


def transformers_conflict(release: str) -> str | None:
    """Why no image of ours holds `release`: its container's transformers, which its tensorrt_llm pins and the image
    keeps, is outside the range the installed pipeline requires (None where it fits or is not tabulated)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    held = container(release).get("transformers")
    ours = next(r for r in map(Requirement, requires("trtllm-pipeline") or []) if r.name == "transformers")
    if not held or ours.specifier.contains(held["version"]):
        return None
    tabulated = [r for r in releases("triton_trtllm_images") if container(r).get("transformers")]
    fitting = [r for r in tabulated if ours.specifier.contains(container(r)["transformers"]["version"])]
    return (
        f"the NVIDIA container for TensorRT-LLM {release} holds transformers {held['version']} (its release notes: "
        f"upstream/triton_trtllm_images.json), which its tensorrt_llm pins, and trtllm-pipeline needs "
        f"transformers{ours.specifier}: build the config on any machine (trtllm-pipeline build) and serve the output "
        f"with the commands `trtllm-pipeline plan CONFIG` prints, or target {' or '.join(fitting)}"
    )


def nvidia_image(release: str) -> str:
    """NVIDIA's container holding `release`, which our stage for it is based on."""
    return f"nvcr.io/nvidia/tritonserver:{container(release)['container']}-trtllm-python-py3"


def whole_config_commands(cfg) -> str:
    """How to build and serve the whole config in our image for its release: two commands, or why none is printed."""
    build = gpu_image_build(cfg)
    if build.command is None:
        return build.shown()
    release = cfg.target.trtllm_version
    return f"{build.shown()}\n  docker run --rm --gpus=all --publish=8000-8002:8000-8002 {image_tag(release)}"


def python_setup(release: str) -> list[str]:
    """The commands of the stage's one RUN: record the container's modules, make our virtualenv see them, install the
    pipeline without replacing them, and check that it uses them."""
    facts = container(release)
    venv_site = f".venv/lib/python{facts['python']}/site-packages"
    commands = []
    if not facts["venv_module"]:  # the release's Dockerfile installs no python3.X-venv: `python3 -m venv` would fail
        commands.append(
            f"apt-get update -q && apt-get install -y --no-install-recommends python{facts['python']}-venv "
            "&& rm -rf /var/lib/apt/lists/*"
        )
    commands += [
        f"python3 -I {CHECK} record --tensorrt-llm {facts['tensorrt_llm']} {RECORD_DIR}",
        f"python3 -m pip freeze > {RECORD_DIR}/freeze.txt",
        f"{facts['interpreter']} -m venv --system-site-packages .venv",
    ]
    if facts["environment"] != "/usr":
        commands.append(f'echo "{container_pth(facts["site_packages"])}" > {venv_site}/{PTH}')
    commands += [
        f".venv/bin/pip install --no-cache-dir --constraint {RECORD_DIR}/constraints.txt -e .",
        f".venv/bin/python -I {CHECK} compare --release {release} {RECORD_DIR}",
        f"python3 -m pip freeze | diff {RECORD_DIR}/freeze.txt -",
    ]
    return commands


def container_pth(site_packages: str) -> str:
    """The line of our virtualenv's .pth file that adds the container's site-packages after ours: `site` runs a .pth
    line that starts with `import`, and `addsitedir` processes the .pth files of the directory it adds."""
    return f"import site; site.addsitedir('{site_packages}')"


def quantize_check(release: str) -> str:
    """The command that quantizes a tiny model with the build's config and overrides (image_check.py quantize)."""
    return f".venv/bin/python -I {CHECK} quantize --release {release} $CONFIG $OVERRIDES"


def stage(release: str) -> str:
    """The Dockerfile stage of `release`: one that stops with the reason where no image of ours can hold it."""
    import shlex

    facts = container(release)
    conflict = transformers_conflict(release)
    if conflict:
        return "\n".join(
            [
                f"# TensorRT-LLM {release}: no image (its container's transformers is outside trtllm-pipeline's).",
                f"FROM {nvidia_image(release)} AS {stage_name(release)}",
                f"RUN echo {shlex.quote(conflict)} >&2 && exit 1",
            ]
        )
    layout = (
        f"its packages live in the virtualenv {facts['environment']}, which ours adds through a .pth file"
        if facts["environment"] != "/usr"
        else f"its packages live in the system's site-packages ({facts['site_packages']})"
    )
    config = (
        f"ARG CONFIG={DEFAULT_CONFIG}"
        if release == DEFAULT_RELEASE
        else 'ARG CONFIG\nRUN test -n "$CONFIG" || { echo \'build this stage with --build-arg=CONFIG='
        f"{IMAGE_CONFIGS}/<a config targeting {release}>.yaml (trtllm-pipeline plan CONFIG prints it)'; exit 1; }}"
    )
    return "\n".join(
        [
            f"# TensorRT-LLM {release}: tritonserver:{facts['container']}-trtllm-python-py3 holds TensorRT-LLM "
            f"{facts['tensorrt_llm']}, torch {facts['torch']},",
            f"# Python {facts['python']}; {layout}.",
            f"# Its TensorRT-LLM pins nvidia-modelopt{facts['modelopt']['requirement']}, which the image checks.",
            f"FROM {nvidia_image(release)} AS {stage_name(release)}",
            config,
            "ARG OVERRIDES=",
            f"ENV CONFIG=${{CONFIG}} OVERRIDES=${{OVERRIDES}} TRTLLM_PIPELINE_CACHE={APP_DIR}/.cache",
            f"WORKDIR {APP_DIR}",
            "COPY pyproject.toml Makefile README.md ./",
            "COPY pipeline pipeline",
            "RUN " + " \\\n && ".join(python_setup(release)),
            f"COPY {IMAGE_CONFIGS} {IMAGE_CONFIGS}",
            f"RUN {quantize_check(release)}",
            "COPY scripts scripts",
            "COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl",
            "EXPOSE 8000 8001 8002",
            'CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES '
            '&& .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]',
        ]
    )


def stages() -> str:
    """Every release's stage, then `gpu` naming the default one, between the marker lines."""
    body = "\n\n".join(stage(release) for release in releases("triton_trtllm_images"))
    alias = f"# The default GPU image (--target=gpu): TensorRT-LLM {DEFAULT_RELEASE}.\n"
    alias += f"FROM {stage_name(DEFAULT_RELEASE)} AS gpu"
    return f"{BEGIN}\n{body}\n\n{alias}\n{END}\n"
