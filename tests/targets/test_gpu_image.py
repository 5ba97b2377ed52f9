"""Our GPU image, one Dockerfile stage per TensorRT-LLM release (pipeline/targets/trtllm/image.py), and the commands
that build it. Each stage is read back as Docker parses it; the virtualenv layout a stage relies on is made here for
real; and `plan` prints commands that work as printed. The image's own check (image_check.py) is tested in
test_image_check.py."""

from __future__ import annotations

import io
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from pipeline.targets.trtllm.image import (
    CHECK,
    container,
    container_pth,
    image_tag,
    nvidia_image,
    stage,
    stage_name,
    stages,
    transformers_conflict,
)
from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS
from pipeline.upstream import releases
from tests.conftest import REPO, run_cli

DOCKERFILE = REPO / "Dockerfile"
FP8_CONFIG = "build_configs/smollm2-135m-fp8.yaml"


def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped), as Docker reads them."""
    stages_found: dict[str, list[tuple[str, str]]] = {}
    for item in DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False).structure:
        if item["instruction"] == "FROM":
            base, _, name = item["value"].partition(" AS ")
            stages_found[name] = [("FROM", base)]
        elif stages_found:
            stages_found[list(stages_found)[-1]].append((item["instruction"], item["value"]))
    return stages_found


def setup_commands(release: str) -> list[str]:
    """The commands of the stage's RUN that sets Python up, in order."""
    stage = dockerfile_stages(DOCKERFILE.read_text())[stage_name(release)]
    run = next(value for instruction, value in stage if instruction == "RUN" and CHECK in value)
    return [command.strip() for command in run.split(" && ")]


def test_every_supported_release_has_a_current_stage_in_the_dockerfile():
    assert set(releases("triton_trtllm_images")) == set(SUPPORTED_VERSIONS)
    text = DOCKERFILE.read_text()
    assert stages() in text, "the GPU stages are stale: run python scripts/dev/render_dockerfile.py"
    assert set(dockerfile_stages(text)) == {"kubectl", "gpu", "cpu", *map(stage_name, SUPPORTED_VERSIONS)}
    assert list(dockerfile_stages(text))[-1] == "cpu", "the CPU image stays the default (last) stage"


def test_a_release_whose_container_transformers_is_outside_ours_gets_a_stage_that_says_why():
    """1.0's container holds transformers 4.53.1, which its tensorrt_llm pins; the pipeline needs 4.56 or later
    (from_pretrained's `dtype`): its stage stops with the reason, and the config's commands say what to do."""
    assert transformers_conflict("1.1") is transformers_conflict("1.2") is None
    conflict = transformers_conflict("1.0")
    assert "transformers 4.53.1" in conflict and "target 1.1 or 1.2" in conflict
    stage_found = dockerfile_stages(DOCKERFILE.read_text())[stage_name("1.0")]
    instructions = [item for item in stage_found if item[0] != "COMMENT"]
    assert instructions == [("FROM", nvidia_image("1.0")), ("RUN", f"echo {shlex.quote(conflict)} >&2 && exit 1")]


@pytest.mark.parametrize("release", releases("triton_trtllm_images"))
def test_each_stage_keeps_the_containers_packages_and_checks_it_uses_them(release):
    facts = container(release)
    stage = dockerfile_stages(DOCKERFILE.read_text())[stage_name(release)]
    assert stage[0] == ("FROM", nvidia_image(release))
    if transformers_conflict(release):  # the stage only says why (the test above)
        return
    commands = setup_commands(release)

    def index(start: str) -> int:
        return next(i for i, command in enumerate(commands) if command.startswith(start))

    record = index(f"python3 -I {CHECK} record --tensorrt-llm {facts['tensorrt_llm']} ")
    venv = index(f"{facts['interpreter']} -m venv --system-site-packages .venv")
    install = index(".venv/bin/pip install ")
    compare = index(f".venv/bin/python -I {CHECK} compare --release {release} ")
    assert record < venv < install < compare < index("python3 -m pip freeze | diff ")
    assert "--constraint" in commands[install] and commands[install].endswith(" -e .")  # no [quant]: theirs
    pth = [command for command in commands if ".pth" in command]
    if facts["environment"] == "/usr":  # packages in the system's site-packages: --system-site-packages sees them
        assert facts["site_packages"].startswith("/usr/") and not pth
    else:  # a virtualenv first on PATH: ours cannot be made from it, so it adds its site-packages, .pth files too
        site = f".venv/lib/python{facts['python']}/site-packages"
        assert pth == [
            f"echo \"import site; site.addsitedir('{facts['site_packages']}')\" > {site}/container-packages.pth"
        ]
    venv_module = [command for command in commands if f"python{facts['python']}-venv" in command]
    assert bool(venv_module) is not facts["venv_module"]
    if venv_module:
        assert commands.index(venv_module[0]) < venv
    # once the configs are in: a real ModelOpt quantization of a tiny model with the build's config and overrides
    after_configs = stage[stage.index(("COPY", "build_configs build_configs")) + 1]
    assert after_configs == ("RUN", f".venv/bin/python -I {CHECK} quantize --release {release} $CONFIG $OVERRIDES")


def test_the_stage_comments_name_the_modelopt_the_release_pins():
    """As tabulated from the release notes: 1.1 and 1.2 pin 0.37, whose quant_cfg is a dict."""
    pins = {release: container(release)["modelopt"] for release in releases("triton_trtllm_images")}
    assert {release: pin["requirement"] for release, pin in pins.items()} == {
        "0.18": "~=0.25.0",
        "0.19": "~=0.27.0",
        "0.20": "~=0.29.0",
        "0.21": "~=0.31.0",
        "1.0": "~=0.33.0",
        "1.1": "~=0.37.0",
        "1.2": "~=0.37.0",
    }
    assert {pin["quant_cfg"] for pin in pins.values()} == {"dict"}
    assert "# Its TensorRT-LLM pins nvidia-modelopt~=0.37.0, which the image checks." in stage("1.2")


def test_releases_before_26_03s_container_need_the_venv_module_installed_and_1_2_reads_a_pth():
    """What the containers' Dockerfiles say, as tabulated: r25.04-r26.02 install no python3.12-venv and keep packages
    in /usr/local; 1.2's 26.07 keeps them in the virtualenv /opt/venv-tritonserver."""
    old = [release for release in releases("triton_trtllm_images") if not container(release)["venv_module"]]
    assert old == ["0.18", "0.19", "0.20", "0.21", "1.0", "1.1"]
    assert container("1.2")["environment"] == "/opt/venv-tritonserver"
    assert {container(release)["environment"] for release in old} == {"/usr"}


def python_in(venv: Path) -> str:
    return str(venv / "bin" / "python")


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def distribution(root: Path, name: str, version: str, requires: str = "") -> Path:
    """A one-module project of our own, to stand in for a package's place (not its behaviour) in a layout."""
    module = name.replace("-", "_")
    (root / name / module).mkdir(parents=True)
    (root / name / module / "__init__.py").write_text("")
    dependencies = f"dependencies = [{requires!r}]\n" if requires else ""
    (root / name / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n{dependencies}'
        f'[tool.setuptools]\npackages = ["{module}"]\n'
    )
    return root / name


def where_it_imports(venv: Path, module: str) -> str:
    result = subprocess.run(
        [python_in(venv), "-I", "-c", f"import {module}; print({module}.__file__)"], capture_output=True, text=True
    )
    return result.stdout.strip() or result.stderr.strip().splitlines()[-1]


def test_the_stages_virtualenv_layout_keeps_a_virtualenvs_packages_made_for_real(tmp_path):
    """1.2's layout made with real venv and pip: a package (a pre-release with a local version, as NVIDIA's torch
    is) installed in a virtualenv, 'theirs'. A virtualenv made from theirs' python does not see it (the defect). One
    made from the base interpreter with a .pth line naming theirs' site-packages sees it, but not what theirs' own .pth
    files add; with the stage's `site.addsitedir` line it sees both, and pip, given the constraint the image check
    writes, takes the package as installed for a project requiring it, installing no second copy."""
    base = str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    wheels = tmp_path / "wheels"
    probe = distribution(tmp_path, "layout-probe", "2.10.0a0+abc.nv25.12")
    app = distribution(tmp_path, "layout-app", "0.1", requires="layout-probe>=2.4")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, probe, app], check=True)
    offline = ["--no-index", "--find-links", str(wheels)]

    theirs, from_theirs, ours = tmp_path / "theirs", tmp_path / "from-theirs", tmp_path / "ours"
    subprocess.run([base, "-m", "venv", "--without-pip", theirs], check=True)  # pip --python installs into it
    subprocess.run([*pip, "--python", python_in(theirs), "install", *offline, "layout-probe"], check=True)
    installed = where_it_imports(theirs, "layout_probe")
    assert installed.startswith(str(site_packages(theirs)))

    subprocess.run(
        [python_in(theirs), "-m", "venv", "--without-pip", "--system-site-packages", from_theirs], check=True
    )
    assert where_it_imports(from_theirs, "layout_probe") == "ModuleNotFoundError: No module named 'layout_probe'"

    # theirs' own .pth files (NVIDIA's site-packages has some) must work in ours too: one adding a directory
    extra = tmp_path / "theirs-extra"
    (extra / "layout_extra").mkdir(parents=True)
    (extra / "layout_extra" / "__init__.py").write_text("")
    (site_packages(theirs) / "theirs-extra.pth").write_text(f"{extra}\n")
    assert where_it_imports(theirs, "layout_extra") == str(extra / "layout_extra" / "__init__.py")

    subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", ours], check=True)
    (site_packages(ours) / "container-packages.pth").write_text(f"{site_packages(theirs)}\n")  # a bare path
    assert where_it_imports(ours, "layout_probe") == installed
    assert where_it_imports(ours, "layout_extra") == "ModuleNotFoundError: No module named 'layout_extra'"
    (site_packages(ours) / "container-packages.pth").write_text(f"{container_pth(str(site_packages(theirs)))}\n")
    assert where_it_imports(ours, "layout_extra") == str(extra / "layout_extra" / "__init__.py")
    (tmp_path / "constraints.txt").write_text("layout-probe==2.10.0a0+abc.nv25.12\n")
    install = [
        *pip[:-1],
        "--python",
        python_in(ours),
        "install",
        *offline,
        "--constraint",
        tmp_path / "constraints.txt",
    ]
    result = subprocess.run([*install, "layout-app"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Requirement already satisfied: layout-probe>=2.4" in result.stdout
    assert where_it_imports(ours, "layout_probe") == installed  # theirs, not a copy of ours
    assert not list(site_packages(ours).glob("layout_probe*"))


# ---------------------------------------------------------------- the printed commands


def printed_image_build(output: str) -> list[str]:
    line = next(line.strip() for line in output.splitlines() if line.strip().startswith("docker build "))
    return shlex.split(line)


def test_plan_prints_a_docker_build_that_works_from_wherever_it_ran(tmp_path):
    """The config path as the image has it (relative to the checkout), the overrides, the stage of the config's
    release, and the checkout as the context: from the checkout `.`, from elsewhere its absolute path."""
    result = run_cli("plan", str(REPO / FP8_CONFIG), "build.max_batch_size=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    command = printed_image_build(result.stdout)
    assert command == [
        "docker",
        "build",
        "--target=gpu-1.2",
        f"--build-arg=CONFIG={FP8_CONFIG}",
        "--build-arg=OVERRIDES=build.max_batch_size=4",
        f"--tag={image_tag('1.2')}",
        str(REPO),
    ]
    stage = command[2].removeprefix("--target=")
    assert stage in dockerfile_stages(DOCKERFILE.read_text()) and (REPO / FP8_CONFIG).is_file()
    assert f"docker run --rm --gpus=all --publish=8000-8002:8000-8002 {image_tag('1.2')}" in result.stdout

    from_checkout = run_cli("plan", FP8_CONFIG)
    assert printed_image_build(from_checkout.stdout)[-1] == "."


def test_plan_refuses_an_image_command_for_a_config_outside_build_configs(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text((REPO / FP8_CONFIG).read_text())
    result = run_cli("plan", str(config))
    assert result.returncode == 0, result.stderr
    message = " ".join(result.stdout.split())
    assert "docker build" not in message
    assert f"the image copies only {REPO / 'build_configs'}/, and {config} is not there: copy it in" in message


def test_deploy_prints_the_cpu_image_command_with_the_config_as_the_image_has_it(tmp_path):
    result = run_cli(
        "deploy", str(REPO / "build_configs/smollm2-135m-cpu.yaml"), "-o", str(tmp_path / "out"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert printed_image_build(result.stdout)[2:] == [
        "--build-arg=CONFIG=build_configs/smollm2-135m-cpu.yaml",
        "--tag=trtllm-pipeline:smollm2-135m-cpu",
        str(REPO),
    ]


def test_serving_a_release_no_image_of_ours_holds_puts_the_gateway_in_front_of_nvidias_container(tmp_path):
    """The gateway in front of trtllm-serve runs in our image; for 1.0, which none holds, the printed command is
    `serve --openai` on the GPU machine itself with NVIDIA's container (on the host's network) as its launcher, and
    for 1.2 our image with the gateway."""
    from pipeline.targets.trtllm.llm_api_serving import Deployment

    def commands(release):
        deployment = Deployment(tmp_path / "engine/model", tmp_path / "engine/o.yaml", release, tmp_path / "repo", "m")
        return deployment.container_commands("127.0.0.1", 8000, 9000)

    old = shlex.split(commands("1.0")[0])
    assert old[:3] == ["trtllm-pipeline", "serve", str(tmp_path / "repo")] and "--openai" in old
    launcher = shlex.split(old[old.index("--launcher") + 1])
    assert launcher[:2] == ["docker", "run"] and launcher[-3:] == ["--network=host", "--init", nvidia_image("1.0")]
    new, _ = commands("1.2")
    assert f" {image_tag('1.2')} " in new and "--openai --openai-port 9000" in new
