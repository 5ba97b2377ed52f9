"""Multi-LoRA on the CPU engine: a tiny Llama built by the real pipeline with a `lora` section, two random PEFT
adapters (non-zero B, one on all seven modules, one on q/v with rsLoRA and another rank), against PEFT's merged
transformers model token for token, alone and mixed in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.runtime.model_runner import ModelRunner
from tests.conftest import run_cli, slow_fixture, write_config
from tests.runtime.test_model_runner import encode, hf_greedy

ADAPTERS = {
    "every": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "qv": {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
}
PROMPTS = ["w1 w2 w3 w4", "w10 w11", "w5 w6 w7 w8 w9 w20 w21"]


def make_adapter(base: Path, out: Path, seed: int, **settings) -> Path:
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False), saved as peft does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():  # peft's random B is small: scale it up so every adapter changes the greedy tokens
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(20)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("lora-adapters")
    return {name: make_adapter(tiny_llama, work / name, seed, **s) for seed, (name, s) in enumerate(ADAPTERS.items())}


def lora_config(path: Path, base: Path, adapters: dict[str, Path], runtime: str = "{}") -> Path:
    """A tiny fp32 build serving `adapters` (max_lora_rank 8, max_loras 2), with the `runtime` section given."""
    listed = ", ".join(f"{{name: {name}, path: {adapter}}}" for name, adapter in adapters.items())
    return write_config(
        path,
        f"""
        model: {{source: hf, path: {base}}}
        target: {{onnx_graph: fused}}
        build: {{max_batch_size: 8, max_input_len: 64, max_seq_len: 128, max_num_tokens: 256}}
        runtime: {runtime}
        lora:
          max_lora_rank: 8
          max_loras: 2
          adapters: [{listed}]
        """,
    )


@slow_fixture(scope="module")
def lora_engine(tiny_llama, adapters, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("lora-engine")
    config = lora_config(work / "tiny-lora.yaml", tiny_llama, adapters)
    result = run_cli("build", str(config), "--output", str(work / "out"), "--until", "lora")
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out"


def merged(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def runner_for(out: Path, extra: tuple[Path, ...] = ()) -> ModelRunner:
    """The engine with the build's adapters (the lora stage's copies), then `extra` ones: lora_uids "0", "1", ..."""
    return ModelRunner.from_dir(out / "engine", num_threads=1, lora_dir=[*(out / "lora" / n for n in ADAPTERS), *extra])


def generate(runner: ModelRunner, ids, uids) -> list[list[int]]:
    out = runner.generate(ids, max_new_tokens=10, end_id=-1, lora_uids=uids, return_dict=True)
    return [out["output_ids"][i, 0, : out["sequence_lengths"][i, 0]].tolist() for i in range(len(ids))]


def test_each_adapter_equals_peft_merged_alone_and_in_one_mixed_batch(tiny_llama, adapters, lora_engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = encode(tokenizer, PROMPTS)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    models = {"-1": base} | {str(uid): merged(tiny_llama, path) for uid, path in enumerate(adapters.values())}
    runner = runner_for(lora_engine)
    expected = {uid: [hf_greedy(model, i, 10) for i in ids] for uid, model in models.items()}
    assert expected["0"] != expected["-1"] and expected["1"] != expected["-1"]  # both adapters change the answers
    for uid in models:
        assert generate(runner, ids, [uid] * len(ids)) == expected[uid], uid
    mixed = ["-1", "0", "1", "0", "-1", "1"]
    rows = [ids[i % len(ids)] for i in range(len(mixed))]
    assert generate(runner, rows, mixed) == [expected[uid][i % len(ids)] for i, uid in enumerate(mixed)]
    assert runner.lora.holders == [0, 0]  # generate gave its slots back


def test_an_added_adapter_reruns_the_lora_stage_not_the_engine(tiny_llama, adapters, lora_engine, tmp_path):
    third = make_adapter(tiny_llama, tmp_path / "third", 5, r=2, lora_alpha=4, target_modules=["down_proj"])
    config = lora_config(tmp_path / "more.yaml", tiny_llama, {**adapters, "third": third})
    result = run_cli("plan", str(config), "--output", str(lora_engine), "--until", "lora", "--json")
    assert result.returncode == 0, result.stderr
    status = {row["stage"]: row["status"] for row in json.loads(result.stdout)}
    assert status == {
        "import": "up to date",
        "quantize": "skipped",
        "export": "up to date",
        "engine": "up to date",
        "lora": "will run",
    }


def test_validate_names_the_adapter_file_and_fix(tiny_llama, adapters, tmp_path):
    wide = make_adapter(tiny_llama, tmp_path / "wide", 6, r=16, lora_alpha=16, target_modules=["q_proj"])
    result = run_cli("validate", str(lora_config(tmp_path / "wide.yaml", tiny_llama, {"wide": wide})))
    message = " ".join(result.stderr.split())
    assert result.returncode == 2
    assert "lora.adapters.0.path" in message and "rank 16 exceeds lora.max_lora_rank 8" in message, message
    result = run_cli("validate", str(lora_config(tmp_path / "gone.yaml", tiny_llama, {"gone": tmp_path / "nowhere"})))
    assert result.returncode == 2 and "nowhere: not a directory" in " ".join(result.stderr.split())


def test_slots_are_reused_least_recently_used_first_and_misfits_are_refused(
    tiny_llama, adapters, lora_engine, tmp_path
):
    """max_loras 2: a third adapter takes the slot used longest ago (its answer is its own), a batch needing three
    is refused, as are an unknown uid, a rank over max_lora_rank and a module the engine carries no LoRA on."""
    third = make_adapter(tiny_llama, tmp_path / "third", 5, r=2, lora_alpha=4, target_modules=["down_proj"])
    runner = runner_for(lora_engine, (third,))
    prompt = [np.array([4, 5, 6])]
    alone = {uid: generate(runner, prompt, [uid]) for uid in ("0", "1", "2")}  # "2" evicts "0", the oldest
    assert runner.lora.slot_of == {"1": 1, "2": 0}
    assert generate(runner, prompt, ["0"]) == alone["0"]  # back in the slot "1" held
    with pytest.raises(ValueError, match="the rows use 3 LoRA adapters, more than the engine's max_loras 2"):
        generate(runner, prompt * 3, ["0", "1", "2"])
    with pytest.raises(ValueError, match=r"unknown LoRA adapter '7'; known: \['0', '1', '2'\]"):
        generate(runner, prompt, ["7"])
    with pytest.raises(ValueError, match="lora_uids has 1 entries for 2 prompts"):
        generate(runner, prompt * 2, ["0"])
    wide = make_adapter(tiny_llama, tmp_path / "wide", 6, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="rank 16 exceeds lora.max_lora_rank 8; raise max_lora_rank to 16"):
        runner.lora.register("wide", wide)
    assert runner.lora.holders == [0, 0]


def test_adapters_keep_their_tokens_with_speculation_and_batch_invariance(lora_engine):
    """Drafts are verified on the row's own adapter (a 1-row pass); a batch-invariant engine's dummy rows and tokens
    take no slot."""
    from pipeline.runtime.speculative import NGram

    repetitive = [np.array([4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5]), np.array([7, 8, 9, 10, 7, 8, 9])]
    uids = ["0", "1"]
    plain = generate(runner_for(lora_engine), repetitive, uids)
    paths = [lora_engine / "lora" / n for n in ADAPTERS]
    for options in ({"speculative": NGram(max_draft_len=4, max_matching_ngram_size=2)}, {"batch_invariant": True}):
        runner = ModelRunner.from_dir(lora_engine / "engine", num_threads=1, lora_dir=paths, **options)
        assert generate(runner, repetitive, uids) == plain, options
        assert [generate(runner, [ids], [uid])[0] for ids, uid in zip(repetitive, uids)] == plain, options
