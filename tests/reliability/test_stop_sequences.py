"""Stop strings through the gateway with the real `openai` client: the streamed and the non-streamed answer are
the greedy text cut at the first stop string, with the same token count, wherever the stop string falls."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest

from tests.serving.test_openai import MODEL, running

OCEAN = [{"role": "user", "content": "Write one sentence about the ocean."}]
PROMPT = "The ocean is"  # greedy: " a vast, interconnected ecosystem that supports life on Earth. The ocean is home"


@pytest.fixture(scope="module")
def client(server, smollm2_build) -> Iterator[openai.OpenAI]:
    with running(server.ports.grpc, smollm2_build / "engine") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def answer(client: openai.OpenAI, chat: bool, stream: bool, **options) -> tuple[str, str, int]:
    """(text, finish_reason, usage.completion_tokens) of a greedy chat or completion, streamed or not."""
    if chat:
        create, request = client.chat.completions.create, {"messages": OCEAN}
    else:
        create, request = client.completions.create, {"prompt": PROMPT, "max_tokens": 40}
    request.update(model=MODEL, temperature=0, **options)
    if not stream:
        reply = create(**request)
        choice = reply.choices[0]
        return choice.message.content if chat else choice.text, choice.finish_reason, reply.usage.completion_tokens
    chunks = list(create(**request, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join((c.delta.content if chat else c.text) or "" for c in choices)
    return text, choices[-1].finish_reason, chunks[-1].usage.completion_tokens


def test_a_stop_inside_a_word_ends_the_answer_there(client):
    """As found: the non-streamed answer went on past the stop string, each later response cut at it and appended
    ('The oce is  v, mysterious,  -inspiring body of w th surrounds the pl  is teeming with life.'), counting
    26 tokens where the stream counted 10."""
    reply = client.chat.completions.create(model=MODEL, messages=OCEAN, temperature=0, stop="a")
    streamed = answer(client, chat=True, stream=True, stop="a")
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("The oce", "stop")
    assert streamed == ("The oce", "stop", reply.usage.completion_tokens)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    "stop",
    [
        "a",  # inside a token: " ocean", " a"
        "cean is",  # across tokens, beginning and ending inside them
        ["life", "ste"],  # the later-listed one comes first (mysterious, ecosystem)
        "ocean is h",  # its beginning comes first and is held back, then shown (chat) or cut (completions)
        " that",  # a whole word, one token: the engine stops at it too
        "is",  # a whole word the engine misses: it generated " is", one token, not "is"
    ],
)
def test_streamed_and_non_streamed_answers_are_the_greedy_text_cut_at_the_first_stop(client, chat, stop):
    greedy, greedy_finish, greedy_tokens = answer(client, chat, stream=False)
    stops = [stop] if isinstance(stop, str) else stop
    cut = min((greedy.find(s) for s in stops if s in greedy), default=-1)
    collected = answer(client, chat, stream=False, stop=stop)
    streamed = answer(client, chat, stream=True, stop=stop)
    assert collected == streamed
    if cut < 0:
        assert collected == (greedy, greedy_finish, greedy_tokens)
    else:
        assert collected[:2] == (greedy[:cut], "stop") and collected[2] <= greedy_tokens
