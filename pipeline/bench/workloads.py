"""The prompts of `bench serve`'s workloads, seeded so every run sends the same: synthetic (raw cuts of the evaluation
text), shared-prefix (chats under one long system prompt: the load prefix caching serves) and grounded (chats asking
to summarise, extract or quote from a passage: the load prompt-lookup speculation serves)."""

from __future__ import annotations

import random

WORKLOADS = ("synthetic", "shared-prefix", "grounded")

# shared-prefix: the system prompt's instructions before the reference text, and the users' question frames
POLICY = (
    "You are the reading assistant of a theatre company. Answer questions about the reference text below in at "
    "most three sentences, quote it where you can, and say so when the text does not answer the question.\n\n"
    "Reference text:\n"
)
QUESTIONS = (
    "Who speaks about {word} in the reference text?",
    "What does the text say about {word}?",
    "Quote the line that mentions {word}.",
    "Why is {word} important in this scene?",
    "Explain the word {word} as it is used here.",
    "Which character would you ask about {word}, and why?",
)
# grounded: tasks answered from the passage itself, so the output repeats its words (prompt-lookup drafts hit)
TASKS = (
    "Summarise the passage in three sentences.",
    "Quote, word for word, the first four lines of the passage.",
    "List every character who speaks in the passage, one per line, with their first line.",
    "Quote exactly the line of the passage that mentions {word}.",
    "Extract every place and person named in the passage.",
)


def _window(tokenizer, ids: list[int], length: int, rng: random.Random) -> str:
    """`length` tokens of the text from a random place, as text."""
    start = rng.randrange(0, max(1, len(ids) - length))
    return tokenizer.decode(ids[start : start + length])


def _words(text: str) -> list[str]:
    """The text's words of five letters or more (any words when it has none), sorted: fillers for question frames."""
    words = sorted({w.strip(".,;:!?'\"[]()-_").lower() for w in text.split()} - {""})
    return [w for w in words if w.isalpha() and len(w) >= 5] or words


def _chat(tokenizer, system: str | None, user: str) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def synthetic_prompts(tokenizer, text: str, count: int, input_len: int, spread: float, seed: int = 0) -> list[str]:
    """`count` prompts cut from a real text, lengths uniform in input_len x [1 - spread, 1 + spread] tokens."""
    rng = random.Random(seed)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for _ in range(count):
        length = max(1, int(input_len * rng.uniform(1 - spread, 1 + spread)))
        prompts.append(_window(tokenizer, ids, length, rng))
    return prompts


def shared_prefix_prompts(
    tokenizer, text: str, count: int, prefix_len: int, seed: int = 0, system: str | None = None
) -> list[str]:
    """Chat requests under one long system prompt of `prefix_len` tokens (POLICY and the text, or `system`), each
    with its own short question: the load a prefix cache serves."""
    rng = random.Random(seed)
    if system is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        policy = len(tokenizer(POLICY, add_special_tokens=False)["input_ids"])
        system = POLICY + _window(tokenizer, ids, max(1, prefix_len - policy), rng)
    words = _words(system)
    return [_chat(tokenizer, system, rng.choice(QUESTIONS).format(word=rng.choice(words))) for _ in range(count)]


def grounded_prompts(tokenizer, text: str, count: int, passage_len: int, seed: int = 0) -> list[str]:
    """Chat requests that each give a passage of `passage_len` tokens and ask to summarise, extract or quote from
    it: outputs that copy their input, where prompt-lookup speculation pays."""
    rng = random.Random(seed)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for _ in range(count):
        passage = _window(tokenizer, ids, passage_len, rng)
        task = rng.choice(TASKS).format(word=rng.choice(_words(passage)))
        prompts.append(_chat(tokenizer, None, f"Passage:\n{passage}\n\n{task}"))
    return prompts


def workload_prompts(
    workload: str,
    tokenizer,
    text: str,
    count: int,
    *,
    input_len: int,
    input_spread: float,
    prefix_len: int,
    passage_len: int,
    system: str | None = None,
    seed: int = 0,
) -> list[str]:
    """`count` prompts of one of WORKLOADS, the same for the same arguments."""
    if workload == "synthetic":
        return synthetic_prompts(tokenizer, text, count, input_len, input_spread, seed)
    if workload == "shared-prefix":
        return shared_prefix_prompts(tokenizer, text, count, prefix_len, seed, system)
    if workload == "grounded":
        return grounded_prompts(tokenizer, text, count, passage_len, seed)
    raise ValueError(f"unknown workload {workload!r}: choose from {', '.join(WORKLOADS)}")
