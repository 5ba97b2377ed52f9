"""Triton repositories: generated for both targets, validated offline, hand-edited mistakes reported."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.errors import BuildStepError
from pipeline.stages import triton_repo
from pipeline.targets.trtllm.guided import TOKENIZER_INFO_FILE, tokenizer_info_problems, write_tokenizer_info
from pipeline.targets.trtllm.repo_checks import model_checks
from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS, backend_facts, required_parameters, template
from pipeline.triton.validate import validate_repo
from pipeline.validation import load_config
from tests.conftest import run_cli, spawn_cli, write_config

REAL_CLIENT_INPUTS = {
    "text_input",
    "max_tokens",
    "bad_words",
    "stop_words",
    "end_id",
    "pad_id",
    "top_k",
    "top_p",
    "temperature",
    "repetition_penalty",
    "random_seed",
    "stream",
    "exclude_input_in_output",
    "return_log_probs",
    "beam_width",
}


def read_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def test_generated_repo_is_valid_and_takes_its_limits_from_the_engine(smollm2_build):
    repo = smollm2_build / "triton_repo"
    result = run_cli("validate-repo", str(repo))
    assert result.returncode == 0, result.stderr
    engine = json.loads((smollm2_build / "engine" / "config.json").read_text())
    models = {p.parent.name: read_config(p) for p in repo.glob("*/config.pbtxt")}
    assert set(models) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
    assert {m.max_batch_size for m in models.values()} == {engine["build_config"]["max_batch_size"]}
    assert (
        REAL_CLIENT_INPUTS
        <= {t.name for t in models["ensemble"].input}
        == {t.name for t in models["tensorrt_llm_bls"].input}
    )
    llm = models["tensorrt_llm"]
    assert llm.backend == "python" and llm.model_transaction_policy.decoupled
    assert Path(llm.parameters["engine_dir"].string_value) == (smollm2_build / "engine").resolve()
    assert llm.parameters["tokens_per_block"].string_value == "32"  # the KV-cache block size, build.tokens_per_block
    # the python model imports the installed package (hashed into the lock), so it is the only code copied
    assert sorted(p.name for p in (repo / "tensorrt_llm" / "1").iterdir() if p.is_file()) == ["model.py"]


def test_validate_repo_reports_every_hand_edit_mistake_with_file_and_line(smollm2_build, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(smollm2_build / "triton_repo", repo)
    llm = repo / "tensorrt_llm" / "config.pbtxt"
    llm.write_text(llm.read_text().replace(str((smollm2_build / "engine").resolve()), "${engine_dir}"))
    ensemble = repo / "ensemble" / "config.pbtxt"
    ensemble.write_text(
        ensemble.read_text()
        .replace('value: "_TOKENS_BATCH"\n    }\n    input_map', 'value: "_NOPE"\n    }\n    input_map', 1)
        .replace('key: "TOKENS_BATCH"\n      value: "_TOKENS_BATCH"', 'key: "TOKENS_BATCH"\n      value: "_NOPE"')
    )
    post = repo / "postprocessing" / "config.pbtxt"
    post.write_text(
        post.read_text().replace(
            'name: "SEQUENCE_LENGTH"\n  data_type: TYPE_INT32', 'name: "SEQUENCE_LENGTH"\n  data_type: TYPE_FP32'
        )
    )
    (repo / "preprocessing" / "1" / "model.py").unlink()

    result = run_cli("validate-repo", str(repo))
    assert result.returncode == 2
    out = " ".join(result.stderr.split())
    line = next(n for n, text in enumerate(llm.read_text().splitlines(), 1) if "${engine_dir}" in text)
    assert f"tensorrt_llm/config.pbtxt:{line}: unfilled placeholder ${{engine_dir}} in 'engine_dir'" in out
    assert "input 'TOKENS_BATCH' reads '_NOPE', which no ensemble input or earlier step produces" in out
    assert "'_SEQUENCE_LENGTH' is TYPE_INT32 but postprocessing.SEQUENCE_LENGTH expects TYPE_FP32" in out
    assert "preprocessing/1/model.py is missing" in out


def trtllm_engine_record(path: Path, tiny_llama: Path, version: str) -> Path:
    """An engine directory's recorded config.json as trtllm-build writes it, plus the tokenizer and the xgrammar
    tokenizer info the engine stage writes beside it (made by the real generator).

    There is no GPU here to build the engine itself; the repository generator only reads this
    record, so the tensorrt_llm model config can be generated and checked offline.
    """
    path.mkdir(parents=True)
    for file in tiny_llama.glob("tokenizer*"):
        shutil.copy2(file, path / file.name)
    write_tokenizer_info(path, path)
    record = {
        "version": version,
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16"},
        "build_config": {
            "max_batch_size": 16,
            "max_input_len": 512,
            "max_seq_len": 1024,
            "max_num_tokens": 4096,
            "max_beam_width": 1,
        },
    }
    (path / "config.json").write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_trtllm_repo_fills_every_parameter_of_the_real_template(tmp_path, tiny_llama, version):
    """Every release: the template's tensors, and every parameter its backend reads without a fallback."""
    config = write_config(
        tmp_path / "gpu.yaml",
        f"""
        target: {{name: trtllm, trtllm_backend: tensorrt, trtllm_version: "{version}"}}
        quantization: {{weights: fp8, kv_cache: fp8}}
        runtime: {{enable_kv_cache_reuse: true, enable_chunked_context: true, cuda_graph_cache_size: 4,
                  max_tokens_in_paged_kv_cache: 65536}}
    """,
    )
    cfg = load_config(config, [])
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, f"{version}.0")
    triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    assert not validate_repo(tmp_path / "repo", model_checks(version)).problems
    llm_text = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "${" not in llm_text
    llm = read_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert llm.backend == "tensorrtllm" and llm.max_batch_size == 16 and llm.model_transaction_policy.decoupled
    assert [t.name for t in llm.input] == [row["name"] for row in template(version)["inputs"]]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert set(required_parameters(version)) <= set(params)
    if version == "0.18":  # guided decoding came with 0.19
        assert not {"guided_decoding_backend", "xgrammar_tokenizer_info_path"} & set(params)
    else:  # on: a backend the release accepts, and the engine directory's tokenizer info, which it would load
        assert params["guided_decoding_backend"] in backend_facts(version)["guided_decoding_backends"]
        assert params["xgrammar_tokenizer_info_path"] == str(engine.resolve() / TOKENIZER_INFO_FILE)
        assert not tokenizer_info_problems(Path(params["xgrammar_tokenizer_info_path"]), version)
    assert params["gpt_model_type"] == "inflight_fused_batching" and params["gpt_model_path"] == str(engine.resolve())
    assert params["enable_kv_cache_reuse"] == "true" and params["enable_chunked_context"] == "true"
    assert params["cuda_graph_mode"] == "true" and params["cuda_graph_cache_size"] == "4"
    assert (
        params["batch_scheduler_policy"] == "guaranteed_no_evict" and params["max_tokens_in_paged_kv_cache"] == "65536"
    )
    assert ("tokenizer_dir" in params) == (version != "0.18")  # the key appeared in 0.19's template
    bls = read_config(tmp_path / "repo" / "tensorrt_llm_bls" / "config.pbtxt")
    renamed = json.loads(bls.parameters["llm_input_names"].string_value)
    assert set(renamed.values()) <= {t.name for t in llm.input}  # the BLS calls the LLM's inputs by its names


def edited_019_repo(tmp_path, tiny_llama, edit) -> list[str]:
    """validate-repo's problems, for 0.19, with a written 0.19 engine repository whose tensorrt_llm config `edit`
    changed (and with no release targeted: those must be none)."""
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    triton_repo.write(
        cfg, trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.19.0"), tmp_path / "repo", log=print
    )
    llm = tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt"
    config = read_config(llm)
    edit(config)
    llm.write_text(text_format.MessageToString(config))
    return validate_repo(tmp_path / "repo", model_checks("0.19")).problems


def test_validate_repo_names_a_required_parameter_the_backend_would_fail_to_load_without(tmp_path, tiny_llama):
    """tensorrtllm_backend v0.19.0 reads guided_decoding_backend with no fallback: a config without it fails to load."""

    def edit(config):
        del config.parameters["guided_decoding_backend"]
        config.parameters["gpt_model_type"].string_value = ""

    problems = edited_019_repo(tmp_path, tiny_llama, edit)
    assert any("parameter 'guided_decoding_backend' is missing" in p and "fails to load" in p for p in problems)
    assert not validate_repo(tmp_path / "repo").problems  # only a targeted release knows what its backend requires


def test_validate_repo_names_a_guided_decoding_backend_the_release_would_fail_to_load_with(tmp_path, tiny_llama):
    """0.19's C++ backend takes xgrammar only (llguidance is an LLM-API choice): a hand-edited config is caught."""

    def edit(config):
        config.parameters["guided_decoding_backend"].string_value = "llguidance"

    problems = edited_019_repo(tmp_path, tiny_llama, edit)
    assert any("'guided_decoding_backend' is 'llguidance'" in p and "xgrammar" in p for p in problems), problems


def test_an_engine_without_its_tokenizer_info_is_refused_naming_the_file_and_the_fix(tmp_path, tiny_llama):
    """0.19's backend fails to load when xgrammar_tokenizer_info_path names no file: say so at triton_repo."""
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.19.0")
    (engine / TOKENIZER_INFO_FILE).unlink()
    with pytest.raises(BuildStepError, match=rf"{TOKENIZER_INFO_FILE} does not exist.*rebuild the engine"):
        triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    assert not (tmp_path / "repo").exists()  # refused before anything is written


def test_our_client_interface_is_each_releases_ensemble_minus_named_features():
    """Clients send the ensemble/BLS tensors of tensorrtllm_backend v0.19 on every release; every other input of
    a release's ensemble is a feature this pipeline does not wire, named with its reason (a new one fails here)."""
    from pipeline.triton import interface
    from pipeline.triton.repo import LLM_INPUT_ALIASES

    for version in SUPPORTED_VERSIONS:
        llm = {row["name"] for row in backend_facts(version)["models"]["tensorrt_llm"]["inputs"]}
        features = set(interface.LLM_FEATURE_INPUTS) - llm  # left out where the release's LLM model lacks them
        ours = {name for name, *_ in interface.CLIENT_INPUTS} - features
        upstream = {row["name"] for row in backend_facts(version)["models"]["ensemble"]["inputs"]}
        renamed = {LLM_INPUT_ALIASES.get(name, name) for name in ours}
        assert ours <= upstream or renamed <= upstream, version
        assert upstream - ours - renamed == set(interface.UNWIRED_CLIENT_INPUTS) & upstream, version


def test_validate_repo_rejects_an_engine_built_by_another_tensorrt_llm_release(tmp_path, tiny_llama):
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.18.2")
    with pytest.raises(BuildStepError, match=r"built by TensorRT-LLM 0\.18\.2, but the repository targets 0\.19"):
        triton_repo.write(
            cfg, engine, tmp_path / "repo", log=lambda _: None
        )  # refuses a repository that fails validation


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))


BROKEN = {
    "placeholder": (
        lambda r: _edit(
            r / "tensorrt_llm/config.pbtxt",
            'key: "gpt_model_type"\n  value {\n    string_value: "inflight_fused_batching"',
            'key: "gpt_model_type"\n  value {\n    string_value: "${batching_strategy}"',
        ),
        r"tensorrt_llm/config\.pbtxt:\d+: unfilled placeholder \$\{batching_strategy\} in 'gpt_model_type'",
    ),
    "syntax": (
        lambda r: _edit(r / "postprocessing/config.pbtxt", "input {", "input {{"),
        r"postprocessing/config\.pbtxt:\d+: ",
    ),
    "unknown field": (
        lambda r: _edit(r / "preprocessing/config.pbtxt", "max_batch_size:", "max_batchsize:"),
        r"preprocessing/config\.pbtxt:\d+: .*max_batchsize",
    ),
    "renamed": (
        lambda r: _edit(r / "postprocessing/config.pbtxt", 'name: "postprocessing"', 'name: "detokenizer"'),
        r"name 'detokenizer' differs from its directory 'postprocessing'",
    ),
    "missing model": (
        lambda r: __import__("shutil").rmtree(r / "tensorrt_llm_bls")
        or _edit(r / "ensemble/config.pbtxt", 'model_name: "postprocessing"', 'model_name: "detokenizer"'),
        r"model 'detokenizer' is not in the repository",
    ),
    "wrong input key": (
        lambda r: _edit(r / "ensemble/config.pbtxt", 'key: "QUERY"', 'key: "PROMPT"'),
        r"input_map key 'PROMPT' is not an input of preprocessing",
    ),
    "unproduced tensor": (
        lambda r: _edit(
            r / "ensemble/config.pbtxt",
            'value: "_REQUEST_INPUT_LEN"\n    }\n    input_map',
            'value: "_X"\n    }\n    input_map',
        ),
        r"input 'input_lengths' reads '_X', which no ensemble input or earlier step produces",
    ),
    "dtype": (
        lambda r: _edit(
            r / "postprocessing/config.pbtxt",
            'name: "TOKENS_BATCH"\n  data_type: TYPE_INT32',
            'name: "TOKENS_BATCH"\n  data_type: TYPE_INT64',
        ),
        r"'_TOKENS_BATCH' is TYPE_INT32 but postprocessing\.TOKENS_BATCH expects TYPE_INT64",
    ),
    "unmapped required": (
        lambda r: _edit(r / "ensemble/config.pbtxt", 'key: "REQUEST_OUTPUT_LEN"', 'key: "END_ID"'),
        r"required input 'REQUEST_OUTPUT_LEN' of preprocessing is not mapped",
    ),
    "unproduced output": (
        lambda r: _edit(r / "ensemble/config.pbtxt", 'value: "text_output"', 'value: "text"'),
        r"ensemble output 'text_output' is produced by no step",
    ),
    "no model.py": (lambda r: (r / "preprocessing/1/model.py").unlink(), r"preprocessing/1/model\.py is missing"),
    "no version dir": (
        lambda r: __import__("shutil").rmtree(r / "postprocessing/1"),
        r"version directory .*postprocessing/1 is missing",
    ),
    "tokenizer path": (
        lambda r: _edit(
            r / "preprocessing/config.pbtxt",
            'key: "tokenizer_dir"\n  value {\n    string_value: "',
            'key: "tokenizer_dir"\n  value {\n    string_value: "/nowhere',
        ),
        r"parameter 'tokenizer_dir' points to /nowhere.*, which does not exist",
    ),
    "engine record": (
        lambda r: Path(_param(r / "tensorrt_llm/config.pbtxt", "gpt_model_path"), "config.json").unlink(),
        r"engine directory .* has no config\.json",
    ),
    "no tokenizer": (
        lambda r: (r.parent / "engine/tokenizer.json").unlink(),
        r"preprocessing/config\.pbtxt: parameter 'tokenizer_dir': "
        r".*/engine/tokenizer\.json or .*/engine/tokenizer\.model is missing "
        r"\(the model loads its tokenizer from .*/engine\)",
    ),
    "no tokenizer config": (
        lambda r: (r.parent / "engine/tokenizer_config.json").unlink(),
        r"parameter 'tokenizer_dir': .*/engine/tokenizer_config\.json is missing",
    ),
    "model directory outside": (
        lambda r: (r / "preprocessing").symlink_to((r / "preprocessing").rename(r.parent / "elsewhere")),
        r"preprocessing/config\.pbtxt: model directory resolves to .*/elsewhere, outside the repository",
    ),
    "step name is a path": (
        lambda r: _edit(r / "ensemble/config.pbtxt", 'model_name: "postprocessing"', 'model_name: "../postprocessing"'),
        r"ensemble/config\.pbtxt: step 2 \(\.\./postprocessing\): "
        r"'\.\./postprocessing' is not a valid Triton model name",
    ),
    "bls calls a missing model": (
        lambda r: _edit(
            r / "tensorrt_llm_bls/config.pbtxt",
            'key: "preprocessing_model_name"\n  value {\n    string_value: "preprocessing"',
            'key: "preprocessing_model_name"\n  value {\n    string_value: "tokenizer"',
        ),
        r"tensorrt_llm_bls/config\.pbtxt: parameter 'preprocessing_model_name': "
        r"model 'tokenizer' is not in the repository",
    ),
    "bls calls a path": (
        lambda r: _edit(
            r / "tensorrt_llm_bls/config.pbtxt",
            'key: "tensorrt_llm_model_name"\n  value {\n    string_value: "tensorrt_llm"',
            'key: "tensorrt_llm_model_name"\n  value {\n    string_value: "/tmp/tensorrt_llm"',
        ),
        r"parameter 'tensorrt_llm_model_name': '/tmp/tensorrt_llm' is not a valid Triton model name",
    ),
}


def _param(path: Path, key: str) -> str:
    return read_config(path).parameters[key].string_value


@pytest.mark.parametrize("mistake", list(BROKEN))
def test_validator_names_file_line_and_field_of_each_mistake(tmp_path, tiny_llama, mistake):
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.19.0")
    triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    break_it, expected = BROKEN[mistake]
    break_it(tmp_path / "repo")
    problems = validate_repo(tmp_path / "repo", model_checks("0.19")).problems
    assert any(re.search(expected, p) for p in problems), problems


def test_validator_reports_an_empty_directory(tmp_path):
    assert validate_repo(tmp_path).problems == [f"{tmp_path}: no model directories with a config.pbtxt"]


def test_serving_a_trtllm_repository_without_gpu_names_what_is_missing(tmp_path, tiny_llama):
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    triton_repo.write(
        cfg, trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.19.0"), tmp_path / "repo", log=lambda _: None
    )
    result = spawn_cli("serve", str(tmp_path / "repo"))
    assert result.returncode == 4
    message = " ".join(result.stderr.split())
    assert (
        "tensorrtllm backend" in message
        and "/opt/tritonserver/bin/tritonserver" in message
        and "/dev/nvidia0" in message
    )


def test_bls_wires_the_models_as_the_ensemble_does():
    """bls.py must run in NVIDIA's container without this package, so it keeps its own copy of the ensemble's
    wiring; read from its source (it imports triton_python_backend_utils), the two must agree."""
    import ast

    from pipeline.triton import interface
    from pipeline.triton.model_config import MODELS_DIR

    tree = ast.parse((MODELS_DIR / "bls.py").read_text())
    bls = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.isupper()
        and isinstance(node.value, (ast.Dict, ast.List))
    }
    steps = {role: (inputs, outputs) for role, inputs, outputs in interface.ENSEMBLE_STEPS}
    pre_in, pre_out = steps["preprocessing"]
    llm_in, llm_out = steps["llm"]
    llm_input_of = {tensor: name for name, tensor in llm_in.items()}

    assert bls["TO_PREPROCESSING"] == {tensor: name for name, tensor in pre_in.items()}
    assert bls["FROM_PREPROCESSING"] == {name: llm_input_of[tensor] for name, tensor in pre_out.items()}
    # the BLS sets `streaming` itself from the client's `stream`
    assert bls["TO_LLM"] == {t: n for n, t in llm_in.items() if not t.startswith("_") and n != "streaming"}
    assert bls["LLM_OUTPUTS"] == list(llm_out)


@pytest.mark.parametrize("name", ["../evil", "/tmp/evil-model"])
def test_the_writer_refuses_a_name_leading_outside_before_writing_anything(tmp_path, tiny_llama, name):
    """Belt and braces behind the config's name rule: a config that bypassed validation still writes nothing."""
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}\n'
        ),
        [],
    )
    cfg.triton.__dict__["postprocessing_name"] = name  # what validate_assignment would refuse
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, "0.19.0")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(BuildStepError, match=rf"model name\(s\) '{re.escape(name)}' would write outside"):
        triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    assert sorted(tmp_path.rglob("*")) == before and not (tmp_path / "repo" / name).exists()


def test_a_build_whose_tokenizer_was_deleted_fails_validate_repo_and_serve_at_once(smollm2_build, tmp_path):
    """Issue #14 item 7: serve used to fail after 30 s with a log tail that lacked the cause. Works on a copy
    (the weights linked, not copied) so the shared build stays intact."""
    built_engine = (smollm2_build / "engine").resolve()
    engine = tmp_path / "engine"
    engine.mkdir()
    for file in built_engine.iterdir():
        if file.name.startswith("model.onnx"):
            (engine / file.name).symlink_to(file)
        else:
            shutil.copy2(file, engine / file.name)
    repo = tmp_path / "triton_repo"
    shutil.copytree(smollm2_build / "triton_repo", repo)
    for config in repo.glob("*/config.pbtxt"):
        config.write_text(config.read_text().replace(str(built_engine), str(engine)))
    assert run_cli("validate-repo", str(repo)).returncode == 0
    (engine / "tokenizer.json").unlink()

    expected = f"parameter 'tokenizer_dir': {engine / 'tokenizer.json'} or {engine / 'tokenizer.model'} is missing"
    result = run_cli("validate-repo", str(repo))
    assert result.returncode == 2 and expected in " ".join(result.stderr.split()), result.stderr
    assert "tensorrt_llm/config.pbtxt: parameter 'engine_dir'" in " ".join(result.stderr.split())
    started = time.monotonic()
    result = spawn_cli("serve", str(repo), timeout=60)
    assert result.returncode == 2 and expected in " ".join(result.stderr.split()), result.stderr
    assert time.monotonic() - started < 20 and "Traceback" not in result.stderr
