#!/usr/bin/env python
"""Train the two LoRA adapters build_configs/smollm2-135m-cpu-lora.yaml serves, on the default model, with peft on CPU.

  upper  every answer in upper case               (rank 8 on all seven linear modules)
  ahoy   every answer starts with "Ahoy, matey!"  (rank 8 on q_proj and v_proj only)

No dataset is downloaded: the training answers are the base model's own greedy chat answers to the built-in chat
questions (pipeline/chat_eval.json) and the questions below, rewritten per behaviour; the loss counts the answer's
tokens only. `--check` answers questions held out of training with the base model and each adapter (merged by peft)
and exits 1 when a behaviour shows on fewer than 4 of 5. Adapters are written as peft's save_pretrained writes them
(adapter_config.json + adapter_model.safetensors), in OUT/<name>/.

  .venv/bin/python scripts/train_lora_adapters.py HF_DIR OUT [--check] [--seed N]

Deterministic: the same HF_DIR and seed write the same bytes on the same CPU, whatever its core count (one thread,
seeded initialisation, a fixed data order); a CPU with other vector kernels can differ in the last bits.

HF_DIR is the imported checkpoint (a build's `import/`, e.g. artifacts/smollm2-135m-cpu/import); `make lora-adapters`
runs it. On one thread, ahoy took 270-730 s per training here (2026-11-28, 2 cores shared with other jobs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = "Ahoy, matey! "
BEHAVIOURS = {
    "upper": {
        "rewrite": str.upper,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "ahoy": {"rewrite": lambda answer: PREFIX + answer, "target_modules": ["q_proj", "v_proj"]},
}
MORE_QUESTIONS = [
    "What is the boiling point of water?",
    "Name a large ocean.",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Give me a word that rhymes with cat.",
    "What is 3 plus 4?",
    "Which planet is known as the red planet?",
    "What do bees make?",
    "Name a fruit that is yellow.",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Tell me a fun fact about dogs.",
    "What is the largest mammal?",
    "Suggest a name for a goldfish.",
    "What language is spoken in Spain?",
    "How do you say hello in French?",
    "What is ice made of?",
    "Name a musical instrument.",
    "Why do leaves fall in autumn?",
    "What is a synonym for happy?",
]
HELD_OUT = [
    "Write a haiku about the sea.",
    "List three primary colours.",
    "What is the tallest mountain on Earth?",
    "Name a vegetable that is green.",
    "How many hours are in a day?",
]
RANK, ALPHA, STEPS, BATCH, LEARNING_RATE, ANSWER_TOKENS = 8, 16, 120, 4, 2e-3, 40
SEED = 0
THREADS = 1  # float sums split over threads round by the split: a fixed count, not the machine's
CHECK_SHARE = 0.8


def chats() -> list[list[dict]]:
    conversations = json.loads((REPO / "pipeline" / "chat_eval.json").read_text())["conversations"]
    return conversations + [[{"role": "user", "content": q}] for q in MORE_QUESTIONS]


def deterministic(seed: int) -> None:
    """Same inputs, same bits: THREADS threads, deterministic kernels only, and random, numpy and torch seeded
    (torch draws the LoRA A matrices)."""
    import torch
    from transformers import set_seed

    torch.set_num_threads(THREADS)
    set_seed(seed, deterministic=True)


def greedy_answers(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    import torch

    answers = []
    for messages in conversations:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return answers


def examples(tokenizer, conversations, answers, rewrite) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per conversation: the prompt's labels -100, the rewritten answer's its tokens + end."""
    out = []
    for messages, answer in zip(conversations, answers):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(rewrite(answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    return out


def train(hf_dir: Path, out: Path, name: str, data, log=print, seed: int = SEED) -> float:
    """One adapter, its batches `data` in order; returns the seconds its steps took."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    deterministic(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=BEHAVIOURS[name]["target_modules"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    started = time.perf_counter()
    for step in range(STEPS):
        batch = [data[(step * BATCH + i) % len(data)] for i in range(BATCH)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == STEPS - 1:
            log(f"  {name} step {step + 1}/{STEPS}: loss {loss.item():.3f}")
    model.save_pretrained(out / name)
    return time.perf_counter() - started


def train_all(hf_dir: Path, out: Path, log=print, seed: int = SEED) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    deterministic(seed)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    conversations = chats()
    log(f"answering {len(conversations)} questions with the base model (the training answers)")
    answers = greedy_answers(base, tokenizer, conversations, ANSWER_TOKENS)
    return {
        name: train(hf_dir, out, name, examples(tokenizer, conversations, answers, spec["rewrite"]), log, seed)
        for name, spec in BEHAVIOURS.items()
    }


def shows(name: str, answer: str) -> bool:
    letters = [c for c in answer if c.isalpha()]
    if name == "upper":
        return bool(letters) and sum(c.isupper() for c in letters) / len(letters) >= 0.9
    return answer.startswith(PREFIX.strip())


def check(hf_dir: Path, out: Path) -> bool:
    """Held-out answers of the base model and of each adapter; True when each behaviour shows on at least
    CHECK_SHARE of them (trained on fifty answers, an adapter misses an odd question: measured, each
    showed on four of the five)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    conversations = [[{"role": "user", "content": q}] for q in HELD_OUT]
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for question, answer in zip(HELD_OUT, greedy_answers(base, tokenizer, conversations, 24)):
        print(f"base  | {question} -> {answer!r}")
    ok = True
    for name in BEHAVIOURS:
        shown_count = 0
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, out / name).merge_and_unload().eval()
        for question, answer in zip(HELD_OUT, greedy_answers(merged, tokenizer, conversations, 24)):
            shown = shows(name, answer)
            shown_count += shown
            print(f"{name:5} | {question} -> {answer!r}{'' if shown else '   <- behaviour missing'}")
        ok &= shown_count >= CHECK_SHARE * len(HELD_OUT)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="the imported checkpoint (a build's import/ directory)")
    parser.add_argument("out", type=Path, help="where OUT/upper and OUT/ahoy are written")
    parser.add_argument("--check", action="store_true", help="then show held-out answers; exit 1 if one lacks it")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the LoRA initialisation's seed (default {SEED})")
    args = parser.parse_args()
    if not (args.hf_dir / "config.json").is_file():
        parser.error(f"{args.hf_dir}: no config.json; pass a build's import/ directory (make build-engine makes one)")
    seconds = train_all(args.hf_dir, args.out, seed=args.seed)
    print("trained: " + ", ".join(f"{name} in {s:.0f} s" for name, s in seconds.items()) + f" -> {args.out}")
    return 0 if not args.check or check(args.hf_dir, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
