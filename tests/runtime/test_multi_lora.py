"""Multi-LoRA on the CPU engine: a tiny Llama built by the real pipeline with a `lora` section, two random PEFT
adapters (non-zero B, one on all seven modules, one on q/v with rsLoRA and another rank), against PEFT's merged
transformers model token for token, alone and mixed in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.scheduler import Scheduler
from tests.conftest import run_cli, slow_fixture, write_config
from tests.runtime.test_model_runner import encode, hf_greedy
from tests.runtime.test_scheduler import Recorder, inputs, prompt, run_to_idle

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


def lora_config(
    path: Path, base: Path, adapters: dict[str, Path], runtime: str = "{}", cpu_loras: int | None = None
) -> Path:
    """A tiny fp32 build serving `adapters` (max_lora_rank 8, max_loras 2, max_cpu_loras `cpu_loras` when given),
    with the `runtime` section given."""
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
          {f"max_cpu_loras: {cpu_loras}" if cpu_loras else ""}
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
    from pipeline.targets.onnxruntime.runtime.speculative import NGram

    repetitive = [np.array([4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5]), np.array([7, 8, 9, 10, 7, 8, 9])]
    uids = ["0", "1"]
    plain = generate(runner_for(lora_engine), repetitive, uids)
    paths = [lora_engine / "lora" / n for n in ADAPTERS]
    for options in ({"speculative": NGram(max_draft_len=4, max_matching_ngram_size=2)}, {"batch_invariant": True}):
        runner = ModelRunner.from_dir(lora_engine / "engine", num_threads=1, lora_dir=paths, **options)
        assert generate(runner, repetitive, uids) == plain, options
        assert [generate(runner, [ids], [uid])[0] for ids, uid in zip(repetitive, uids)] == plain, options


# ---------------------------------------------------------------- one tenant's adapter never reaches another's rows


def scheduled(runner: ModelRunner, rows: list[tuple[list[int], int]], max_tokens: int = 6) -> list[Recorder]:
    """Each (prompt, lora_task_id) submitted as a job of its own, all admitted into one batch and run to the end."""
    scheduler = Scheduler(runner)
    recorders = [Recorder() for _ in rows]
    for (ids, task_id), recorder in zip(rows, recorders):
        scheduler.submit(inputs([ids], max_tokens, end_id=-1, lora_task_id=task_id), recorder)
    run_to_idle(scheduler)
    return recorders


def served_runner(lora_engine: Path) -> ModelRunner:
    """The engine with the build's adapters under task ids 1 and 2, as the Triton model registers them."""
    runner = ModelRunner.from_dir(lora_engine / "engine", num_threads=1)
    for task_id, name in enumerate(ADAPTERS, 1):
        runner.lora.register(name, lora_engine / "lora" / name, task_id)
    return runner


def test_nan_in_a_resident_slot_fails_its_own_request_and_no_other_row_changes(lora_engine):
    """Below every check: NaN written straight into the A of a resident slot. Its x @ A is NaN in that slot's columns
    for every row of the pass; the branch's Where leaves the other rows exact zeros there, so the base model's and the
    other adapter's rows in the same batch decode exactly as alone, and the poisoned request fails naming its
    adapter (a multiply by the mask would have turned every row to NaN)."""
    runner = served_runner(lora_engine)
    runner.lora.register("poisoned", lora_engine / "lora" / "qv", 3)
    rows = [(prompt(5, 1), 0), (prompt(4, 2), 1), (prompt(6, 3), 3)]
    alone = [scheduled(runner, [row])[0].tokens() for row in rows[:2]]
    (slot,) = runner.lora.acquire(["poisoned"])
    runner.lora.holders[slot] -= 1  # resident, held by no row
    for buffer in runner.lora.a.values():
        buffer[slot] = np.nan
    runner.lora._views.clear()  # the bound copies of A are rebuilt from the poisoned slot
    base, other, poisoned = scheduled(runner, rows)
    assert [base.tokens(), other.tokens()] == alone
    assert not base.errors() and not other.errors()
    assert poisoned.errors() == [
        "LoRA adapter 'poisoned' produced non-finite logits (NaN or inf) for this request; it was stopped"
    ]


def test_an_adapter_with_nan_weights_never_enters_a_slot_and_later_requests_are_refused(lora_engine):
    """Below the load check: an adapter object whose B is NaN (the file check would have refused it). B is summed
    over every row's zeros, so it must never enter a slot: its request fails naming the tensor, the rows beside it
    decode as alone, and later requests naming it are refused at once."""
    from pipeline import peft_adapters

    runner = served_runner(lora_engine)
    broken = peft_adapters.load(lora_engine / "lora" / "every")
    a, b = broken.weights[1, "down_proj"]
    broken.weights[1, "down_proj"] = (a, np.full_like(b, np.nan))
    runner.lora.register("broken", broken, 3)
    rows = [(prompt(5, 1), 0), (prompt(4, 2), 2), (prompt(6, 3), 3)]
    alone = [scheduled(runner, [row])[0].tokens() for row in rows[:2]]
    base, other, failed = scheduled(runner, rows)
    assert [base.tokens(), other.tokens()] == alone
    message = "LoRA adapter 'broken' holds non-finite weights (layer 1 down_proj lora_B); it is no longer served"
    assert failed.errors() == [message]
    assert scheduled(runner, [rows[2]])[0].errors() == [message]


def test_an_adapter_file_is_checked_header_first_and_a_non_finite_weight_is_refused(lora_engine, tmp_path):
    """The safetensors header is checked against the engine before a tensor is read (a misfit 8 MB lora_A costs no
    memory), and a NaN weight is refused naming the file and the tensor."""
    import shutil
    import tracemalloc

    from safetensors.numpy import load_file, save_file

    runner = served_runner(lora_engine)
    source = lora_engine / "lora" / "every"
    for name, change in {
        "wide": lambda tensors, key: tensors | {key: np.ones((4, 2**19), np.float32)},
        "nan": lambda tensors, key: tensors | {key: np.full_like(tensors[key], np.nan)},
    }.items():
        shutil.copytree(source, tmp_path / name)
        tensors = load_file(source / "adapter_model.safetensors")
        key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
        save_file(change(tensors, key), tmp_path / name / "adapter_model.safetensors")
    tracemalloc.start()
    with pytest.raises(ValueError, match=r"layer 0 q_proj: lora_A \[4, 524288\] and lora_B \[64, 4\] do not fit"):
        runner.lora.register("wide", tmp_path / "wide", 3)
    assert tracemalloc.get_traced_memory()[1] < 2**21  # the 8 MB tensor was never read
    tracemalloc.stop()
    with pytest.raises(
        ValueError,
        match=r"tensor base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight "
        r"holds NaN; a LoRA weight must be finite",
    ):
        runner.lora.register("nan", tmp_path / "nan", 3)
    assert set(runner.lora.adapters) == set(ADAPTERS)


def test_registered_adapters_are_capped_and_the_registry_is_taken_before_a_request(lora_engine, tmp_path):
    """lora.max_cpu_loras bounds the adapters registered; `serve`'s registry file (the gateway's load and unload
    routes) is read before each request: a task id names an adapter only once it is registered, never after."""
    from pipeline.adapter_registry import Registry

    runner = served_runner(lora_engine)
    runner.lora.max_registered = 3
    registry = Registry(tmp_path / "registry.json")
    scheduler = Scheduler(runner, registry=registry)
    ask = inputs([prompt(4)], 3, end_id=-1, lora_task_id=5)
    refused = Recorder()
    scheduler.submit(ask, refused)
    assert refused.errors() == ["lora_task_id 5 names no loaded LoRA adapter; loaded: 1 (every), 2 (qv)"]
    registry.write({"added": {"path": str(lora_engine / "lora" / "qv"), "task_id": 5}})
    served = Recorder()
    scheduler.submit(ask, served)
    run_to_idle(scheduler)
    assert not served.errors() and len(served.tokens()) == 3
    with pytest.raises(ValueError, match="3 adapters are registered, lora.max_cpu_loras is 3; unload one"):
        runner.lora.register("fourth", lora_engine / "lora" / "every", 6)
    registry.write({})
    gone = Recorder()
    scheduler.submit(ask, gone)
    assert gone.errors() == ["lora_task_id 5 names no loaded LoRA adapter; loaded: 1 (every), 2 (qv)"]


def test_a_name_registered_again_never_reads_the_prefix_blocks_its_old_weights_wrote(lora_engine):
    """Prefix-cache blocks are keyed by the adapter's registration, not its name: once `qv` is registered again
    with other weights, the same prompt is prefilled afresh and answers as those weights do, never from the K/V
    its old weights left in the cache."""
    runner = served_runner(lora_engine)
    scheduler = Scheduler(runner, kv_cache_reuse=True, tokens_per_block=4)
    shared = prompt(13, 1)  # three full blocks

    def ask(task_id: int) -> list[int]:
        recorder = Recorder()
        scheduler.submit(inputs([shared], 6, end_id=-1, lora_task_id=task_id), recorder)
        run_to_idle(scheduler)
        assert not recorder.errors()
        return recorder.tokens()

    old = ask(2)
    hits = scheduler.counters["prefix_cache_hit_blocks_total"]
    assert ask(2) == old and scheduler.counters["prefix_cache_hit_blocks_total"] == hits + 3  # the cache works
    every = ask(1)
    assert every != old  # the two adapters answer this prompt differently
    runner.lora.register("qv", lora_engine / "lora" / "every", 2)
    hits = scheduler.counters["prefix_cache_hit_blocks_total"]
    assert ask(2) == every and scheduler.counters["prefix_cache_hit_blocks_total"] == hits
