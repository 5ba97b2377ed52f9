"""Speculative decoding by n-gram (prompt-lookup) drafting, for the fused-graph CPU runtime.

Why: a decode step of a small model on CPU costs about as much for a few tokens as for one, and the text a
request continues (a summary, a rewrite, code under edit) often repeats its own prompt. So each step drafts up
to `max_draft_len` tokens from the request itself, runs them with its last token in one forward pass and keeps
the longest prefix greedy decoding agrees with: plain greedy decoding's output in fewer passes, up to the
numerics of a several-token pass (identical on fp32 engines; int8-compute engines round it differently and may
part after a near tie: docs/serving.md "Speculative decoding"). No
draft model: as TensorRT-LLM's NGram mode (NGramDecodingConfig), whose setting names runtime.speculative uses.

How: `ngram_drafts` finds the latest earlier occurrence of the request's last n tokens (n from
max_matching_ngram_size down to 1) and proposes what followed it. `speculate_step` replaces the batch's decode
step: each drafting row runs its drafts on its own, on a 1-row view of the batch's KV buffers
(GroupQueryAttention takes several new tokens after a cache only at batch size 1), accepted drafts are
appended as if sampled, and the row's logits become those after its last accepted draft, so `sample` picks
the bonus token next, exactly as it would have. The rejected drafts' KV positions are rolled back by the
row's length alone; later writes overwrite them. Requests whose drafts keep failing draft less often
(`MAX_BACKOFF`). Written by hand: transformers' prompt lookup (`prompt_lookup_num_tokens`) drives its own
models' caches, not this runtime's in-place KV buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from pipeline.targets.onnxruntime.runtime.guided import constrain
from pipeline.targets.onnxruntime.runtime.sampling import append, broken_rows, finish_reason, greedy_log_probs

# After m verifications in a row that accepted nothing, a request drafts only every 2**min(m, MAX_BACKOFF)-th token:
# text that does not repeat itself then costs (nearly) plain decoding's passes. Output does not depend on it.
MAX_BACKOFF = 4


@dataclass(frozen=True)
class NGram:
    """runtime.speculative with type ngram (pipeline/config/sections.py SpeculativeSection)."""

    max_draft_len: int
    max_matching_ngram_size: int


# The Triton model's parameters carrying runtime.speculative (max_draft_len 0: no speculation).
PARAMETERS = ("speculative_max_draft_len", "speculative_max_matching_ngram_size")


def from_config(section) -> NGram | None:
    """runtime.speculative (pipeline.config.sections.SpeculativeSection or None) for the runtime."""
    return NGram(section.max_draft_len, section.max_matching_ngram_size) if section is not None else None


def to_parameters(config: NGram | None) -> dict[str, int]:
    """The Triton model's parameters for `config`; `from_parameters` reads them back."""
    return dict(zip(PARAMETERS, (config.max_draft_len, config.max_matching_ngram_size) if config else (0, 0)))


def from_parameters(parameters: Mapping[str, str]) -> NGram | None:
    drafts, ngram = (int(parameters.get(name) or 0) for name in PARAMETERS)
    return NGram(drafts, ngram) if drafts else None


def ngram_drafts(tokens: list[int], max_draft_len: int, max_matching_ngram_size: int) -> list[int]:
    """Up to `max_draft_len` tokens that followed the latest earlier occurrence of the last n tokens (the latest
    followed by `max_draft_len` tokens when there is one), trying n = max_matching_ngram_size first (a longer match
    predicts better) down to 1; [] when nothing matches."""
    sequence = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_matching_ngram_size, len(sequence) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)  # every n-gram but the suffix itself
        starts = np.flatnonzero((windows == sequence[-n:]).all(axis=1)) + n
        if len(starts):  # the latest with a full draft after it: in a loop the latest of all is the suffix's neighbour
            full = starts[starts + max_draft_len <= len(sequence)]
            start = int(full[-1] if len(full) else starts[-1])
            return sequence[start : start + max_draft_len].tolist()
    return []


def speculate_step(runner, batch, config: NGram) -> tuple[int, int]:
    """The decode step of `batch` with n-gram drafts; returns (draft tokens verified, drafts accepted).

    Only plain-greedy rows draft (their choice is the argmax, which the verification pass computes for every
    draft at once). Drafts are cut so that no accepted draft can finish its request (see `accept`) and so that
    they fit the row's cache: the last token a request may take always comes from `sample`. When every row
    drafts, each runs its last token and drafts in one pass; otherwise all last tokens run in one batched decode
    step and only the drafting rows run their drafts after it, so rows without drafts cost no pass of their own.
    """
    drafts = []
    for row, request in enumerate(batch.requests):
        room = min(
            request.params.max_new_tokens - len(request.output) - 1,
            runner.cache.room(batch, row) - 1,  # the last token takes a position too
            config.max_draft_len,
        )
        due = len(request.output) % (1 << min(request.draft_misses, MAX_BACKOFF)) == 0
        ok = request.params.plain_greedy and room > 0 and due
        proposed = ngram_drafts(request.tokens, room, config.max_matching_ngram_size) if ok else []
        if proposed and request.matcher is not None:  # a guided row's drafts end where its grammar would refuse one
            proposed = proposed[: request.matcher.validate_tokens(proposed)]
        drafts.append(proposed)
    split = not all(drafts)
    if split:
        runner.decode_step(batch)
    accepted = 0
    for row, request in enumerate(batch.requests):
        if not drafts[row]:
            continue
        if split:  # the logits after the last token came from the batched step
            logits = np.concatenate([batch.logits[row : row + 1], runner.cache.verify(batch, row, drafts[row])])
        else:
            logits = runner.cache.verify(batch, row, [request.last_token, *drafts[row]])
        taken = accept(request, drafts[row], logits)
        batch.lengths[row] -= len(drafts[row]) - taken  # roll back the rejected drafts
        batch.logits[row] = logits[taken]
        request.draft_misses = 0 if taken else request.draft_misses + 1
        accepted += taken
    return sum(map(len, drafts)), accepted


def accept(request, drafts: list[int], logits: np.ndarray) -> int:
    """Append the drafts greedy decoding agrees with (logits[i] predicts drafts[i]); returns how many.

    A draft that would finish the request (end_id, a stop word, max_new_tokens) is left to `sample`, which
    takes it from logits[taken] with the same stop logic, so finished rows never linger in the batch. A guided row's
    logits[i] are masked by its grammar as it stands after the drafts before i, as `sample` would mask them.
    """
    taken = 0
    while taken < len(drafts):
        row = logits[taken : taken + 1]
        if broken_rows(row)[0]:  # left to `sample`, which fails the request
            break
        if request.matcher is not None:  # the grammar's state moves with each accepted draft (`append`)
            constrain(request.matcher, row[0])
        chosen = row.argmax(axis=1)
        if chosen[0] != drafts[taken] or finish_reason(request, drafts[taken]) is not None:
            break
        append(request, drafts[taken], float(greedy_log_probs(row, chosen)[0]))
        taken += 1
    return taken
