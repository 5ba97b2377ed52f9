"""Answers sent on a thread of their own: the LLM model's scheduler hands each answer here and goes on with the next
step, instead of waiting for the response's trip to tritonserver (measured: 0.78 ms a token at one request, up to a
tenth of a decode step). What piles up while a send is under way goes out merged."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol


class Answerer(Protocol):
    def respond(self, row, answer) -> None:
        """Send one answer: a row's (tokens, log-probabilities, cumulative log-probability, final), or with row END
        an error message or (None) the empty final response."""


END = "end"  # the row of a request's last answer that carries no tokens: an error or the empty final response


class Outbox:
    """One thread sending every request's answers in order. What piled up while a send was under way goes out
    merged: a row's tokens in one response (a client reading slower than the engine writes gets fewer, larger
    responses), a request's end after its tokens."""

    def __init__(self, log_error: Callable[[str], None]):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.log_error = log_error
        self.thread = threading.Thread(target=self._run, name="outbox", daemon=True)
        self.thread.start()

    def put(self, responder: Answerer, row, answer) -> None:
        self.queue.put((responder, row, answer))

    def close(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            pending = [self.queue.get()]
            while not self.queue.empty():
                pending.append(self.queue.get())
            for (responder, row), answer in merged([p for p in pending if p is not None]).items():
                try:
                    responder.respond(row, answer)
                except Exception as exc:  # a client gone mid-send: the others are still answered
                    self.log_error(f"sending a response failed: {exc!r}")
            if None in pending:
                return


def merged(pending: list[tuple]) -> dict:
    """(responder, row) -> one answer: a row's token answers joined in order (its last one's cumulative
    log-probability and final flag). A request's end, its last answer, stays after its tokens: dicts keep the order
    in which keys were first seen."""
    answers: dict = {}
    for responder, row, answer in pending:
        key = (responder, row)
        if row != END and key in answers:
            tokens, log_probs, _, _ = answers[key]
            more, more_log_probs, cum_log_prob, final = answer
            answer = (tokens + more, log_probs + more_log_probs, cum_log_prob, final)
        answers[key] = answer
    return answers
