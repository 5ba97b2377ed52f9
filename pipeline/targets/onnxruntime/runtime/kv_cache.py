"""KV cache accounted in blocks, with prefix reuse: the in-flight batching scheduler's admission and prefix cache.

Accounting. The pool is `runtime.max_tokens_in_paged_kv_cache` tokens in blocks of `build.tokens_per_block`. As with
TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy, a request is admitted only when it can reserve every block it can
ever need, ceil((prompt + max_new_tokens) / tokens_per_block), less the full prompt blocks it shares from the prefix
cache; it gives them back when it retires, is cancelled or fails. Rows are not padded to each other, so a short
request next to a long one costs only its own blocks. The pool is an account, not the memory layout: ONNX Runtime's
CPU GroupQueryAttention has no paged KV, so each running row keeps its KV in a contiguous buffer (`SharedCache`).

Reuse (`runtime.enable_kv_cache_reuse`). A prompt's full blocks are named by chained hashes (blake2b of the parent's
hash and the block's token ids: stable across processes, unlike `hash()`), so a block names its whole prefix. Once a
request's prompt is prefilled, its full blocks are copied out of its row (K/V of every layer, numpy) into the store,
where they stay after it finishes, with a reference count per holder; a block nobody holds is evicted, least recently
used first (the deepest blocks of a prompt before their parents), when the pool needs its space. A request whose
prompt starts with stored blocks holds them instead of reserving new ones, its row buffer is seeded with their K/V and
only the rest of its prompt is prefilled (at least its last token: its logits are needed).

Why copy the prefix into the row rather than recompute it: on the SmolLM2-135M int8 engine (2 cores shared with
other jobs, so times are noisy but measured side by side), a 1,000-token shared prompt plus 24 tokens took 5.1 s to
prefill whole and 0.19 s with the 992 reused tokens copied in (27x less; 24 ms of it is allocating and seeding the
row's buffer), and copying those 992 tokens out of a row after its prefill took 42 ms, once per stored block. The
store costs num_layers x 2 x kv_heads x head_size x 4 bytes per token (46 KiB for SmolLM2-135M) on top of the
running rows' buffers, and a server with varied prompts fills it up to the whole pool (blocks nobody holds are evicted
only when an admission needs their room): 8,192 tokens, the default config's pool, are 360 MiB.
Only the fused graph is seeded: the optimum graph (`ConcatCache`, left-padded rows) is still accounted
in blocks but never reuses (`validate` refuses `enable_kv_cache_reuse` with `target.onnx_graph: optimum`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pipeline.targets.onnxruntime.runtime.sampling import Request


@dataclass(eq=False)
class Block:
    """One stored prompt block: its chained hash and K/V [past inputs, kv_heads, tokens_per_block, head_size]."""

    key: bytes
    kv: np.ndarray
    refs: int = 0


@dataclass(eq=False)
class Reservation:
    """What one admitted request holds: `private` pool blocks of its own and references to stored blocks."""

    private: int
    keys: list[bytes]  # chained hashes of its prompt's full blocks
    shared: list[Block] = field(default_factory=list)  # stored blocks it holds, its prefix first
    queried: int = 0  # prompt blocks looked up in the store at admission
    hits: int = 0  # of which found: their K/V seeds the row instead of being prefilled


def chain_keys(tokens: list[int], tokens_per_block: int, adapter: str | None = None) -> list[bytes]:
    """The chained hash of every full block of `tokens`; a LoRA adapter's registration seeds the chain, since its K/V
    differ from the base model's for the same tokens (blocks are never shared across adapters, nor with what a
    re-registered name served before)."""
    keys, parent = [], b"" if adapter is None else hashlib.blake2b(adapter.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = np.asarray(tokens[start : start + tokens_per_block], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockManager:
    """The block pool and the prefix store of one scheduler (not thread-safe: the scheduler thread owns it)."""

    def __init__(self, pool_tokens: int, tokens_per_block: int, reuse: bool):
        self.tokens_per_block = tokens_per_block
        self.num_blocks = pool_tokens // tokens_per_block
        self.reuse = reuse
        self.stored: dict[bytes, Block] = {}
        self.evictable: OrderedDict[bytes, Block] = OrderedDict()  # stored blocks nobody holds, least recent first
        self.reservations: dict[int, Reservation] = {}  # id(Request) -> what it holds
        self.private = 0  # pool blocks reserved by requests and not stored

    def blocks_for(self, request: Request) -> int:
        """Blocks a request can ever fill: its prompt and every token it may generate."""
        return -(-(len(request.prompt) + request.params.max_new_tokens) // self.tokens_per_block)

    @property
    def used_blocks(self) -> int:
        """Blocks held by admitted requests (stored blocks nobody holds count as free: they are evicted on demand)."""
        return self.private + len(self.stored) - len(self.evictable)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    def reserve(self, requests: list[Request]) -> list[Reservation] | None:
        """Reserve the blocks of all `requests` (one job's rows) or of none: None when the pool cannot hold them."""
        plans = []
        for request in requests:
            keys = chain_keys(request.prompt, self.tokens_per_block, request.adapter_key) if self.reuse else []
            queried = (len(request.prompt) - 1) // self.tokens_per_block if self.reuse else 0  # keep the last token
            hits = []
            for key in keys[:queried]:
                if key not in self.stored:
                    break
                hits.append(self.stored[key])
            plans.append((request, keys, queried, hits))
        held = {id(block) for *_, hits in plans for block in hits}
        need = sum(self.blocks_for(request) - len(hits) for request, _, _, hits in plans)
        evictable = sum(id(block) not in held for block in self.evictable.values())
        unclaimed = self.num_blocks - self.private - len(self.stored)
        if need > unclaimed + evictable:
            return None
        reservations = []
        for request, keys, queried, hits in plans:
            reservation = Reservation(self.blocks_for(request) - len(hits), keys, queried=queried, hits=len(hits))
            for block in hits:
                self._hold(block, reservation)
            self.reservations[id(request)] = reservation
            reservations.append(reservation)
        self.private += need
        while self.private + len(self.stored) > self.num_blocks:
            key, _ = self.evictable.popitem(last=False)
            del self.stored[key]
        return reservations

    def prefix(self, request: Request) -> np.ndarray | None:
        """The stored K/V a request's row starts from, [past inputs, kv_heads, tokens, head_size] (None: no hit)."""
        reservation = self.reservations[id(request)]
        if not reservation.hits:
            return None
        return np.concatenate([block.kv for block in reservation.shared[: reservation.hits]], axis=2)

    def store_prompt(self, request: Request, export: Callable[[int, int], np.ndarray]) -> None:
        """After a prompt is prefilled: store its full blocks not stored yet; `export(start, stop)` returns the
        row's K/V of those positions. Each stored block moves from the request's private blocks to the store."""
        reservation = self.reservations[id(request)]
        first, tpb = len(reservation.shared), self.tokens_per_block
        if first >= len(reservation.keys):
            return
        kv = export(first * tpb, len(reservation.keys) * tpb)
        for index, key in enumerate(reservation.keys[first:]):
            block = self.stored.get(key)
            if block is None:  # another request may have stored the same block since this one was admitted
                block = self.stored[key] = Block(key, kv[:, :, index * tpb : (index + 1) * tpb].copy())
            self._hold(block, reservation)
            reservation.private -= 1
            self.private -= 1

    def release(self, request: Request) -> None:
        """A request retired, was cancelled or failed: its private blocks are free, its stored blocks stay."""
        reservation = self.reservations.pop(id(request), None)
        if reservation is None:
            return
        self.private -= reservation.private
        for block in reversed(reservation.shared):  # deepest first: evicted before the blocks they extend
            block.refs -= 1
            if not block.refs:
                self.evictable[block.key] = block

    def _hold(self, block: Block, reservation: Reservation) -> None:
        block.refs += 1
        self.evictable.pop(block.key, None)
        reservation.shared.append(block)
