"""The models the quality gate runs with transformers and torch, as `quality.Model`s: a checkpoint's own forward (the
fp32 or bfloat16 reference every target is scored against), PEFT's merge of a LoRA adapter, and the forward and
greedy helpers the targets' references share. Loaded on first use and released after, one model at a time."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.quality import Loaded, LogitsFn, Model


def transformers_reference(hf_dir: Path, checkpoint_hash: str | None = None, dtype: str = "float32") -> Model:
    """The Hugging Face model in `hf_dir`, run by transformers in `dtype` (`verify.reference_dtype`), loaded on first
    use. Its greedy answers are slow, so with the checkpoint's hash (the import stage's `output_hash`) they are kept
    in the cache."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    key = checkpoint_hash and (
        f"{checkpoint_hash} {dtype} torch {torch.__version__} transformers {transformers.__version__}"
    )
    load = partial(AutoModelForCausalLM.from_pretrained, hf_dir, dtype=getattr(torch, dtype))
    name = "fp32 model" if dtype == "float32" else f"{dtype} transformers model"
    return loaded_torch_model(name, hf_dir, lambda: load().eval(), end_of_turn(hf_dir), key)


def peft_reference(hf_dir: Path, adapter_dir: Path, name: str) -> Model:
    """PEFT's merge of the LoRA adapter in `adapter_dir` into the fp32 model in `hf_dir`, loaded on first use: the
    reference of an adapter's quality gate (the `lora` stage), whatever runs the adapter."""

    def merged():
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()

    return loaded_torch_model(f"fp32 model merged with {name}", adapter_dir, merged, end_of_turn(hf_dir))


def loaded_torch_model(name: str, path: Path, load: Callable, end_id: int, answers_key: str | None = None) -> Model:
    """A transformers model as a `Model` that `load`s it on first use and drops it on `release`."""
    model = Loaded(load)
    return Model(
        name,
        path,
        lambda ids: torch_logits_fn(model())(ids),
        lambda prompt, max_new_tokens, end: torch_greedy(model(), prompt, max_new_tokens, end),
        end_id,
        answers_key=answers_key,
        release=model.release,
    )


def hf_logits_fn(hf_dir: Path) -> LogitsFn:
    import torch
    from transformers import AutoModelForCausalLM

    return torch_logits_fn(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())


def hf_logits(hf_dir: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The logits of the fp32 transformers model in `hf_dir` for each [1, n] input, the model freed before they are
    returned, so that a check against another model of the same weights holds one model at a time."""
    import gc

    logits_fn = hf_logits_fn(hf_dir)
    logits = [logits_fn(ids) for ids in inputs]
    del logits_fn
    gc.collect()
    return logits


def torch_logits_fn(model) -> LogitsFn:
    """A transformers model's logits, as float32 (a bfloat16 model's exactly: numpy has no bfloat16)."""
    import torch

    def logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.float().numpy()

    return logits


def torch_greedy(model, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
    """A transformers model's greedy continuation, ending with `end_id` when it ends its turn. One prompt at a
    time: a left-padded batch changes the matmul shapes, so its logits are not bitwise those of a single prompt."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
        )
    return out[0, len(prompt) :].tolist()


def end_of_turn(hf_dir: Path) -> int:
    """The token a chat answer ends with: the generation config's (first) eos, else the tokenizer's. Read as
    `from_pretrained` reads it (generation_config.json, else one made from config.json), without the weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(hf_dir)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(hf_dir))
    eos = generation.eos_token_id
    return int(np.ravel(eos)[0]) if eos is not None else AutoTokenizer.from_pretrained(hf_dir).eos_token_id
