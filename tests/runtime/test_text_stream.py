"""The LLM model's `text_output` (`runtime.text_stream`) and its outbox (`runtime.outbox`): the text deltas a client
of the LLM model reads add up to what the BLS streams (the postprocessing model's decode), however the tokens are
grouped, and answers sent on the outbox's thread arrive in order, merged only within a row."""

from __future__ import annotations

import random
import threading

import pytest

from pipeline.targets.onnxruntime.runtime.outbox import END, Outbox, merged
from pipeline.targets.onnxruntime.runtime.text_stream import DECODE, TextStream, anchor_of


def bls_text(tokenizer, tokens: list[int]) -> str:
    """The BLS's text of a whole answer: the postprocessing model's decode after its anchor, a character the tokens
    end inside dropped."""
    anchor = anchor_of(tokenizer)
    text = tokenizer.decode(anchor + tokens, **DECODE)
    return text[len(tokenizer.decode(anchor, **DECODE)) :].rstrip("\ufffd")


def streamed(tokenizer, tokens: list[int], rng: random.Random) -> str:
    stream, text, start = TextStream(tokenizer, anchor_of(tokenizer)), "", 0
    while start < len(tokens):
        end = start + rng.choice([1, 1, 1, 2, 3])
        text += stream.add(tokens[start:end], final=end >= len(tokens))
        start = end
    return text


def sentencepiece_like():
    """A BPE tokenizer with SentencePiece's word-boundary marker ("▁Paris"), whose tokens decoded alone lose their
    leading space: the case the window's anchor and previous tokens are for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "the sea waves of Paris and a café in the old town naïve ships sail".split()
    rng = random.Random(1)
    text = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_build):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_build / "engine")


def test_text_deltas_add_up_to_the_bls_text_with_byte_level_bpe(smollm2_tokenizer):
    """SmolLM2's byte-level BPE: emojis and accents span several tokens, and random ids end inside characters."""
    rng = random.Random(0)
    texts = ['Hello, world! 😀 naïve café — 日本語, {"a": 1}  spaces\tand\n\nlines', "<|im_start|>user\nhi 🇫🇷"]
    answers = [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    answers += [[rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(40)] for _ in range(200)]
    for tokens in answers:
        assert streamed(smollm2_tokenizer, tokens, rng) == bls_text(smollm2_tokenizer, tokens), tokens
    special = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert streamed(smollm2_tokenizer, answers[0] + [special], rng) == bls_text(smollm2_tokenizer, answers[0])


def test_text_deltas_keep_sentencepiece_leading_spaces():
    tokenizer, rng = sentencepiece_like(), random.Random(2)
    tokens = tokenizer.encode("the old town of Paris and a café", add_special_tokens=False)
    assert streamed(tokenizer, tokens, rng) == bls_text(tokenizer, tokens) == " the old town of Paris and a café"
    stream = TextStream(tokenizer, anchor_of(tokenizer))
    deltas = [stream.add([token]) for token in tokens]
    assert " Paris" in deltas or " Par" in deltas, deltas  # a word's first token, streamed alone, keeps its space


class Recorder:
    """An answerer that records what the outbox sends it, on which thread; with a `gate`, each send waits for it."""

    def __init__(self, sent: list, gate: threading.Event | None = None):
        self.sent, self.gate, self.sending = sent, gate, threading.Event()

    def respond(self, row, answer) -> None:
        self.sending.set()
        if self.gate is not None:
            self.gate.wait(5)
        self.sent.append((self, row, answer, threading.current_thread().name))


def test_answers_waiting_for_a_send_go_out_merged_per_row_and_in_order():
    first, second = Recorder([]), Recorder([])
    pending = [
        (first, 0, ([1], [-0.1], -0.1, False)),
        (second, 0, ([7], [-0.5], -0.5, False)),
        (first, 1, ([4], [-0.4], -0.4, False)),
        (first, 0, ([2, 3], [-0.2, -0.3], -0.6, False)),
        (second, END, "adapter 'broken' produced NaN"),
        (first, 0, ([5], [-0.5], -1.1, True)),
    ]
    assert list(merged(pending).items()) == [
        ((first, 0), ([1, 2, 3, 5], [-0.1, -0.2, -0.3, -0.5], -1.1, True)),
        ((second, 0), ([7], [-0.5], -0.5, False)),
        ((first, 1), ([4], [-0.4], -0.4, False)),
        ((second, END), "adapter 'broken' produced NaN"),
    ]


def test_the_outbox_sends_on_its_own_thread_and_merges_what_piled_up():
    sent, gate, errors = [], threading.Event(), []
    outbox = Outbox(errors.append)
    slow = Recorder(sent, gate)  # its first send waits: the tokens put meanwhile pile up
    outbox.put(slow, 0, ([1], [-1.0], -1.0, False))
    assert slow.sending.wait(5)
    for token in (2, 3, 4):
        outbox.put(slow, 0, ([token], [-1.0], -float(token), token == 4))
    outbox.put(slow, END, None)
    gate.set()
    outbox.close()
    assert [(row, answer) for _, row, answer, _ in sent] == [
        (0, ([1], [-1.0], -1.0, False)),
        (0, ([2, 3, 4], [-1.0, -1.0, -1.0], -4.0, True)),
        (END, None),
    ]
    assert {thread for *_, thread in sent} == {"outbox"} and not errors
    assert not outbox.thread.is_alive()
