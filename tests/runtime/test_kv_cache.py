"""KV-cache blocks and prefix reuse: the block manager alone (accounting, eviction), then driven by the scheduler on
the shared fp32 tiny engine (reused prefixes give the same tokens as prefilling them)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.targets.onnxruntime.runtime.kv_cache import BlockManager, chain_keys
from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams
from pipeline.targets.onnxruntime.runtime.scheduler import Scheduler
from tests.runtime.test_scheduler import NO_END, Recorder, generate_alone, inputs, prompt

TPB = 4  # tokens per block in these tests: prompts of a few dozen tokens span several blocks


def request(tokens: list[int], max_new: int) -> Request:
    return Request(tokens, SamplingParams(max_new, NO_END))


def export_of(req: Request):
    """A stand-in for a row's K/V: position i holds the prompt's token i, so a seeded prefix shows what it holds."""
    return lambda start, stop: np.asarray(req.prompt[start:stop], dtype=np.float32).reshape(1, 1, -1, 1)


def assert_accounting(kv: BlockManager, live: list[Request]) -> None:
    """Used blocks are the live requests' own plus the stored blocks they hold, each once; a stored block's count is
    its holders, and it is evictable exactly when it has none."""
    held = [block for r in live for block in kv.reservations[id(r)].shared]
    assert set(kv.reservations) == {id(r) for r in live}
    assert kv.used_blocks == sum(kv.reservations[id(r)].private for r in live) + len({id(b) for b in held})
    assert kv.used_blocks + kv.free_blocks == kv.num_blocks and kv.private + len(kv.stored) <= kv.num_blocks
    for block in kv.stored.values():
        assert block.refs == sum(b is block for b in held)
        assert (block.key in kv.evictable) == (block.refs == 0)


def test_a_thousand_random_requests_with_cancellations_leave_no_block_behind():
    rng = np.random.default_rng(7)
    kv = BlockManager(pool_tokens=40 * TPB, tokens_per_block=TPB, reuse=True)
    systems = [[int(t) for t in rng.integers(0, 50, int(rng.integers(4, 25)))] for _ in range(6)]
    queue, live, prefilled, admitted, hits = [], [], set(), 0, 0
    while admitted < 1000 or live:
        for _ in range(int(rng.integers(0, 3)) if admitted + len(queue) < 1000 else 0):
            tail = [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 11)))]
            queue.append([request(systems[rng.integers(len(systems))] + tail, int(rng.integers(1, 13)))])
            if rng.random() < 0.1:  # a two-row job: both rows or neither
                queue[-1].append(request(systems[0] + tail, 3))
        while queue and (reservations := kv.reserve(queue[0])) is not None:  # FIFO
            job = queue.pop(0)
            for req, reservation in zip(job, reservations):
                shared = reservation.hits * TPB
                prefix = kv.prefix(req)
                assert (prefix is None) == (not shared)
                if shared:  # the stored K/V of exactly this prompt's first blocks
                    assert prefix.ravel().tolist() == req.prompt[:shared] and shared < len(req.prompt)
                hits += reservation.hits
            live += job
            admitted += len(job)
        for req in list(live):
            if id(req) not in prefilled and rng.random() < 0.6:
                kv.store_prompt(req, export_of(req))
                prefilled.add(id(req))
            if rng.random() < 0.25:  # retired, cancelled (maybe before its prompt was stored) or failed
                kv.release(req)
                live.remove(req)
        if rng.random() < 0.01:  # a failed step: everything held is released, twice does no harm
            for req in live + live:
                kv.release(req)
            live.clear()
        prefilled &= {id(req) for req in live}  # ids of released requests are reused
        assert_accounting(kv, live)
    assert not queue and kv.used_blocks == 0 and kv.free_blocks == kv.num_blocks and kv.private == 0
    assert hits > 500 and len(kv.evictable) == len(kv.stored) > 0


def test_unheld_blocks_are_evicted_least_recently_used_first_and_deepest_first():
    kv = BlockManager(pool_tokens=4 * TPB, tokens_per_block=TPB, reuse=True)

    def run(tokens: list[int], max_new: int = 3) -> int:
        """Admitted, prefilled and retired; returns the blocks it reused."""
        req = request(tokens, max_new)
        (reservation,) = kv.reserve([req])
        kv.store_prompt(req, export_of(req))
        kv.release(req)
        return reservation.hits

    a, b, c, d = ([i * 10 + j for j in range(5)] for i in range(4))  # 5 tokens + 3 new: 2 blocks, the first stored
    assert [run(a), run(b), run(a), run(c)] == [0, 0, 1, 0]  # a's block, used again, is more recent than b's
    assert len(kv.stored) == 3 and run(d) == 0  # d's 2 blocks beside 3 stored: one goes, the least recently used
    assert chain_keys(b, TPB)[0] not in kv.stored and [run(a), run(c), run(d), run(b)] == [1, 1, 1, 0]

    assert chain_keys(a, TPB)[0] not in kv.stored  # b's blocks took a's place
    assert kv.reserve([request(d, 3)])[0].hits == 1  # d's block is held, c's and b's are evictable
    assert kv.reserve([request(list(range(100, 109)), 3)]) is None  # 3 blocks: only 2 are free or evictable
    assert chain_keys(d, TPB)[0] in kv.stored  # held blocks are never evicted

    kv = BlockManager(pool_tokens=4 * TPB, tokens_per_block=TPB, reuse=True)
    e = list(range(9))  # 2 full blocks stored
    assert run(e) == 0 and run(list(range(50, 59))) == 0  # 3 blocks beside 2 stored: e's deeper block goes
    assert kv.reserve([request(e, 3)])[0].hits == 1


def run_waves(scheduler: Scheduler, waves: list[list[tuple[list[list[int]], int]]]) -> list[list[list[int]]]:
    """Each wave's jobs (prompts, max_tokens) submitted together and run until idle; every job's tokens per row."""
    recorders = []
    for wave in waves:
        for prompts, max_tokens in wave:
            recorders.append((Recorder(), len(prompts)))
            scheduler.submit(inputs(prompts, max_tokens, end_id=NO_END), recorders[-1][0])
        while not scheduler.idle:
            scheduler.step()
    assert all(recorder.finals() == 1 and not recorder.errors() for recorder, _ in recorders)
    return [[recorder.tokens(row) for row in range(rows)] for recorder, rows in recorders]


@pytest.mark.parametrize("chunked_context", [False, True], ids=["whole-prefill", "chunked-context"])
def test_reused_prefixes_give_the_tokens_prefilling_gives_and_are_counted(runner, chunked_context):
    system = prompt(22, 5)  # 5 full blocks
    waves = [
        [([system + prompt(3, 1)], 6)],  # 6 full blocks stored
        [  # hits 5 (its 6th block differs), 4 (its last token is computed), 5 and 5
            ([system + prompt(5, 2)], 6),
            ([system[:20]], 5),
            ([system + prompt(2, 3), system + prompt(9, 4)], 4),
        ],
        [([prompt(30, 9)], 6), ([system + prompt(3, 1)], 7)],  # hits 0 and 6
    ]
    outputs, counters = {}, {}
    for reuse in (False, True):
        scheduler = Scheduler(runner, tokens_per_block=TPB, kv_cache_reuse=reuse, chunked_context=chunked_context)
        outputs[reuse] = run_waves(scheduler, waves)
        counters[reuse] = {name: value for name, value in scheduler.counters.items() if "prefix_cache" in name}
        assert scheduler.kv.used_blocks == 0 and not scheduler.kv.reservations
        assert scheduler.gauges["kv_cache_blocks_free"] == scheduler.kv.num_blocks == 8 * 128 // TPB
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == [generate_alone(runner, system + prompt(3, 1), 6)]
    assert counters[False] == dict.fromkeys(counters[False], 0)
    assert counters[True] == {
        "prefix_cache_queried_blocks_total": 6 + (6 + 4 + 5 + 7) + (7 + 6),
        "prefix_cache_hit_blocks_total": 25,
        "prefix_cache_reused_tokens_total": 25 * TPB,
    }


def test_random_requests_on_a_small_pool_evict_reuse_and_give_every_block_back(runner):
    rng = np.random.default_rng(11)
    scheduler = Scheduler(runner, kv_budget=40 * TPB, tokens_per_block=TPB, kv_cache_reuse=True, chunked_context=True)
    systems = [prompt(int(rng.integers(8, 30)), k) for k in range(5)]
    submitted, step = [], 0
    while len(submitted) < 80 or not scheduler.idle:
        for _ in range(int(rng.integers(0, 3)) if len(submitted) < 80 else 0):
            tokens = systems[rng.integers(5)] + prompt(int(rng.integers(1, 9)), int(rng.integers(240)))
            max_tokens, cancel_at = int(rng.integers(1, 9)), step + int(rng.integers(1, 6))
            cancelled = (lambda at=cancel_at: step >= at) if rng.random() < 0.15 else (lambda: False)
            recorder = Recorder()
            assert scheduler.submit(inputs([tokens], max_tokens, end_id=NO_END), recorder, is_cancelled=cancelled)
            submitted.append((tokens, max_tokens, recorder))
        scheduler.step()
        step += 1
        assert_accounting(
            scheduler.kv,
            [*(scheduler.batch.requests if scheduler.batch else []), *(r for r, _ in scheduler.prefilling)],
        )
    distinct_blocks = {key for tokens, _, _ in submitted for key in chain_keys(tokens, TPB)}
    assert len(distinct_blocks) > scheduler.kv.num_blocks  # so blocks were evicted to make room
    assert scheduler.kv.used_blocks == 0 and len(scheduler.kv.stored) == len(scheduler.kv.evictable) > 0
    assert scheduler.counters["prefix_cache_hit_blocks_total"] > 100
    finished = 0
    for tokens, max_tokens, recorder in submitted:
        assert recorder.finals() == 1 and not recorder.errors()
        if len(recorder.tokens()) == max_tokens:  # not cancelled
            assert recorder.tokens() == generate_alone(runner, tokens, max_tokens)
            finished += 1
    assert finished > 50
