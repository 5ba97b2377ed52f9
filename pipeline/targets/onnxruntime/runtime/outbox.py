"""Answers and metrics sent on a thread of their own: the LLM model's scheduler hands them here and goes on with the
next step, instead of waiting for each trip to tritonserver (measured at one request, 2026-11-28: a response took
0.78 ms a token, a tenth of a decode step, and updating Triton's metrics 15% of the engine thread's time). What
piles up while a send is under way goes out merged."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol


class Answerer(Protocol):
    def respond(self, row, answer) -> None:
        """Send one answer: a row's (tokens, log-probabilities, cumulative log-probability, final), or with row END
        an error message or (None) the empty final response."""


END = "end"  # the row of a request's last answer that carries no tokens: an error or the empty final response
METRICS = object()  # in the queue, where an answer's responder would be: a metrics update


class Outbox:
    """One thread sending every request's answers in order, and the metrics (`on_metrics`: counter increments,
    gauge levels) before the answers that follow them, so a client that reads the metrics after its last token sees
    it counted. What piled up while a send was under way goes out merged: a row's tokens in one response (a client
    reading slower than the engine writes gets fewer, larger responses), a request's end after its tokens, the
    metrics as one update."""

    def __init__(
        self, log_error: Callable[[str], None], on_metrics: Callable[[dict, dict], None] = lambda *updates: None
    ):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.log_error, self.on_metrics = log_error, on_metrics
        self.thread = threading.Thread(target=self._run, name="outbox", daemon=True)
        self.thread.start()

    def put(self, responder: Answerer, row, answer) -> None:
        self.queue.put((responder, row, answer))

    def put_metrics(self, increments: dict[str, float], levels: dict[str, float]) -> None:
        self.queue.put((METRICS, increments, levels))

    def close(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            pending = [self.queue.get()]
            while not self.queue.empty():
                pending.append(self.queue.get())
            updates = [p for p in pending if p is not None and p[0] is METRICS]
            if updates:
                increments: dict[str, float] = {}
                for _, more, _ in updates:
                    for name, amount in more.items():
                        increments[name] = increments.get(name, 0.0) + amount
                self._safely(self.on_metrics, increments, {k: v for _, _, levels in updates for k, v in levels.items()})
            answers = [p for p in pending if p is not None and p[0] is not METRICS]
            for (responder, row), answer in merged(answers).items():
                self._safely(responder.respond, row, answer)
            if None in pending:
                return

    def _safely(self, send: Callable, *args) -> None:
        try:
            send(*args)
        except Exception as exc:  # e.g. a client gone mid-send: the others are still answered
            self.log_error(f"sending to tritonserver failed: {exc!r}")


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
