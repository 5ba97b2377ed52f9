"""The rows decoding together (`Batch`) and the two KV-cache layouts a `ModelRunner` keeps them in.

Why two: the engine's graph decides. The fused graph (GroupQueryAttention writes in place into a buffer the batch
owns; rows of any length, no padding, nothing copied per step) is served by `SharedCache`, the optimum-onnx graph
(present = concat(past, new); rows left-padded) by `ConcatCache`. Both bind the KV cache with ONNX Runtime I/O
binding, so it never round-trips through numpy between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.targets.onnxruntime.runtime.sampling import Request

# Upper bound on the prefill logits buffer ([rows, chunk, vocab] float32): bounds the chunk width.
PREFILL_LOGITS_BYTES = 128 << 20


@dataclass
class Batch:
    """Rows decoding together. Row i of every KV tensor is requests[i]'s slot; `logits` holds each
    row's next-token logits, waiting for `sample`. How the cache is laid out is the graph's business
    (see ConcatCache and SharedCache); `length` is the longest row's cache length."""

    requests: list[Request]
    past: dict  # input name -> OrtValue or ndarray [rows, kv_heads, positions, head_size]
    logits: np.ndarray  # float32 [rows, vocab]
    mask: np.ndarray | None = None  # ConcatCache: int64 [rows, length], 1 where a position holds a real token
    lengths: np.ndarray | None = None  # SharedCache: int [rows], tokens in each row's cache
    bindings: dict = field(default_factory=dict)  # SharedCache: rows bound -> I/O binding of `past`, reused
    row_bindings: dict = field(default_factory=dict)  # SharedCache: row -> binding of its 1-row view (speculation)
    lora_bound: dict = field(default_factory=dict)  # SharedCache with LoRA: id(binding) -> the weights it binds

    @property
    def length(self) -> int:
        return self.mask.shape[1] if self.mask is not None else int(self.lengths.max(initial=0))

    def __len__(self) -> int:
        return len(self.requests)


class ConcatCache:
    """The optimum-onnx graph: present = concat(past, new), so every step returns a longer cache.

    Rows are left-padded together (attention_mask 0, position_ids = cumsum(mask) - 1); the cache
    stays in ORT-allocated OrtValues between steps (I/O binding). Long prompts are prefilled in
    column chunks so the [rows, chunk, vocab] logits stay small.
    """

    def __init__(
        self, session, *, num_kv_heads: int, head_size: int, vocab_size: int, max_num_tokens: int, max_seq_len: int
    ):
        self.session = session
        self.num_kv_heads, self.head_size, self.vocab_size, self.max_num_tokens = (
            num_kv_heads,
            head_size,
            vocab_size,
            max_num_tokens,
        )
        self.past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.output_names = [o.name for o in session.get_outputs()]
        # optimum's Gemma 2/3 graphs have no position_ids: they derive positions from attention_mask
        self.takes_positions = any(i.name == "position_ids" for i in session.get_inputs())

    def _forward(self, input_ids: np.ndarray, mask: np.ndarray, past: dict) -> tuple[np.ndarray, dict]:
        """Run the graph on new tokens given the cache; returns last-position logits and the new cache (OrtValues)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, dtype=np.int64))
        if self.takes_positions:
            positions = mask.cumsum(axis=1)[:, -input_ids.shape[1] :] - 1
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(np.maximum(positions, 0), dtype=np.int64))
        for name in self.past_names:
            value = past[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(self.output_names, binding.get_outputs()))
        logits = np.array(outputs["logits"].numpy()[:, -1, :])
        return logits, {name: outputs[name.replace("past_key_values.", "present.")] for name in self.past_names}

    def prefill(self, requests: list[Request]) -> Batch:
        length = max(len(r.prompt) for r in requests)
        ids = np.zeros((len(requests), length), dtype=np.int64)  # padding ids are masked out: any valid id does
        mask = np.zeros((len(requests), length), dtype=np.int64)
        for row, request in enumerate(requests):
            ids[row, length - len(request.prompt) :] = request.prompt
            mask[row, length - len(request.prompt) :] = 1
        budget = min(self.max_num_tokens, max(1, PREFILL_LOGITS_BYTES // (4 * self.vocab_size)))
        chunk = max(1, budget // len(requests))
        past = {
            name: np.zeros((len(requests), self.num_kv_heads, 0, self.head_size), dtype=np.float32)
            for name in self.past_names
        }
        start = 0
        while start < length:
            end = min(length, start + chunk)
            logits, past = self._forward(ids[:, start:end], mask[:, :end], past)
            start = end
        return Batch(list(requests), past, logits, mask=mask)

    def extend(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Up to `budget` more prompt tokens of one request into its own 1-row batch (chunked context)."""
        if partial is None:
            empty = {
                name: np.zeros((1, self.num_kv_heads, 0, self.head_size), dtype=np.float32) for name in self.past_names
            }
            partial = Batch([request], empty, None, mask=np.zeros((1, 0), dtype=np.int64))
        start = partial.length
        chunk = request.prompt[start : start + budget]
        partial.mask = np.ones((1, start + len(chunk)), dtype=np.int64)
        partial.logits, partial.past = self._forward(np.array([chunk]), partial.mask, partial.past)
        return partial

    def decode_step(self, batch: Batch) -> None:
        last = np.array([[r.last_token] for r in batch.requests], dtype=np.int64)
        batch.mask = np.concatenate([batch.mask, np.ones((len(batch), 1), dtype=np.int64)], axis=1)
        batch.logits, batch.past = self._forward(last, batch.mask, batch.past)

    @staticmethod
    def select(batch: Batch, rows: list[int]) -> Batch:
        """Keep `rows`, trimming the left padding no kept row needs."""
        mask = batch.mask[rows]
        start = int(np.argmax(mask.any(axis=0))) if rows else batch.length
        past = {name: np.ascontiguousarray(_numpy(value)[rows, :, start:]) for name, value in batch.past.items()}
        return Batch([batch.requests[i] for i in rows], past, batch.logits[rows], mask=mask[:, start:])

    @staticmethod
    def merge(a: Batch, b: Batch) -> Batch:
        """The shorter cache is left-padded to the longer one."""
        length = max(a.length, b.length)

        def pad(batch: Batch, value) -> np.ndarray:
            return np.pad(_numpy(value), ((0, 0), (0, 0), (length - batch.length, 0), (0, 0)))

        past = {name: np.concatenate([pad(a, a.past[name]), pad(b, b.past[name])]) for name in a.past}
        mask = np.concatenate(
            [np.pad(a.mask, ((0, 0), (length - a.length, 0))), np.pad(b.mask, ((0, 0), (length - b.length, 0)))]
        )
        return Batch(a.requests + b.requests, past, np.concatenate([a.logits, b.logits]), mask=mask)


class SharedCache:
    """The fused graph (`pipeline/targets/onnxruntime/graph.py`): GroupQueryAttention writes each step's keys
    and values in place into a buffer the batch owns, [rows, kv_heads, capacity, head_size].

    Rows need no padding: each has its own length (seqlens_k), so decoding copies nothing; only a
    request joining or leaving copies the buffers once. The capacity is the longest row's prompt +
    max_new_tokens, so memory follows what the batch can need, not max_seq_len. Prompts are
    prefilled together right-padded when they fit in max_num_tokens, else row by row, in chunks of
    max_num_tokens when one prompt is longer (chunked context).
    """

    CAPACITY_STEP = 64  # capacities are rounded up to this: fewer distinct shapes, fewer re-pads on merge

    def __init__(
        self,
        session,
        *,
        num_kv_heads: int,
        head_size: int,
        vocab_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        batch_invariant: bool = False,
        lora=None,
    ):
        self.session = session
        self.lora = lora  # pipeline.targets.onnxruntime.runtime.lora_slots.LoraSlots when the graph carries LoRA
        self.num_kv_heads, self.head_size, self.max_num_tokens, self.max_seq_len = (
            num_kv_heads,
            head_size,
            max_num_tokens,
            max_seq_len,
        )
        self.past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.logits_width = next(o.shape[-1] for o in session.get_outputs() if o.name == "logits")  # the vocabulary
        self.spare_rows = int(batch_invariant)  # the dummy row of batch-invariant passes (see _forward)

    def bind(self, past: dict):
        """An I/O binding with the cache buffers as both past and present (GQA writes in place)."""
        import onnxruntime as ort

        binding = self.session.io_binding()  # logits are bound per run (_forward)
        for name, buffer in past.items():
            value = ort.OrtValue.ortvalue_from_numpy(buffer)  # wraps the buffer, no copy
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
        return binding

    def _forward(
        self,
        batch: Batch,
        input_ids: np.ndarray,
        lengths: np.ndarray,
        logits_index: np.ndarray,
        prompt: bool = True,
        row: int | None = None,
    ) -> np.ndarray:
        """Run new tokens on the batch's first len(input_ids) buffer rows (or on row `row` alone); `lengths` are
        those rows' cache lengths after them. Returns logits [len(logits_index), vocab].

        Batch-invariant: ONNX Runtime's MatMulNBits int8-compute kernel gives the token in a pass's single-row
        remainder (odd row counts) other bits than the rows it takes in pairs, so every pass gets an even number of
        rows. A decode step gets a dummy row (the spare buffer row, 1 token); a prompt pass of one row a dummy
        token after its tokens, so a 1-token chunk takes GroupQueryAttention's prompt path as the whole prompt
        does (the dummy's K/V lands past the row's length and is overwritten later); the logits rows, which the
        graph gathers before lm_head, are doubled when odd.
        """
        rows, width = input_ids.shape
        wanted = len(logits_index)
        if self.spare_rows and rows * width % 2:
            if rows == 1 and prompt:
                input_ids, lengths = np.pad(input_ids, ((0, 0), (0, 1))), lengths + 1
            else:
                input_ids, lengths = np.pad(input_ids, ((0, 1), (0, 0))), np.append(lengths, 1)
        if self.spare_rows and wanted % 2:
            logits_index = np.append(logits_index, logits_index[-1])
        binding = self._binding(batch, len(input_ids), row)
        if self.lora is not None:
            own = [r.lora_slot for r in (batch.requests[:rows] if row is None else [batch.requests[row]])]
            self._bind_lora(batch, binding, own + [None] * (len(input_ids) - len(own)))
        # logits into a buffer of ours: no output to fetch, which would wrap every bound KV buffer too (0.3 ms a step)
        logits = np.empty((len(logits_index), self.logits_width), dtype=np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", (lengths - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(lengths.max(), dtype=np.int32))
        binding.bind_cpu_input("logits_index", np.ascontiguousarray(logits_index, dtype=np.int64))
        self.session.run_with_iobinding(binding)
        return logits[:wanted]

    def _bind_lora(self, batch: Batch, binding, slots: list) -> None:
        """The pass's LoRA inputs: each row's slot in the masks, and the weights of the slot range its rows use
        (rebound only when they change, as rows with other adapters come and go)."""
        bounds, masks = self.lora.feeds(slots)
        weights = self.lora.weights(bounds)
        if batch.lora_bound.get(id(binding)) is not weights:
            for name, value in weights.items():
                binding.bind_cpu_input(name, value)
            batch.lora_bound[id(binding)] = weights
        for name, mask in masks.items():
            binding.bind_cpu_input(name, mask)

    def _binding(self, batch: Batch, rows: int, row: int | None):
        """The I/O binding of the batch's first `rows` buffer rows, or of row `row` alone; kept, so the next steps
        bind only their four small inputs."""
        bindings, key = (batch.bindings, rows) if row is None else (batch.row_bindings, row)
        if key not in bindings:
            window = slice(0, rows) if row is None else slice(row, row + 1)  # contiguous: wrapped, not copied
            bindings[key] = self.bind({name: buffer[window] for name, buffer in batch.past.items()})
        return bindings[key]

    def _buffers(self, rows: int, capacity: int) -> dict:
        return {
            name: np.zeros((rows + self.spare_rows, self.num_kv_heads, capacity, self.head_size), dtype=np.float32)
            for name in self.past_names
        }

    def _capacity(self, requests: list[Request]) -> int:
        # + spare_rows: a batch-invariant prefill chunk may write one dummy token past the prompt
        need = max(len(r.prompt) + r.params.max_new_tokens for r in requests) + self.spare_rows
        return max(need, min(self.max_seq_len, -(-need // self.CAPACITY_STEP) * self.CAPACITY_STEP))

    def prefill(self, requests: list[Request]) -> Batch:
        lengths = np.array([len(r.prompt) for r in requests])
        width = int(lengths.max())
        if width * len(requests) <= self.max_num_tokens:
            batch = Batch(list(requests), self._buffers(len(requests), self._capacity(requests)), None, lengths=lengths)
            ids = np.zeros((len(requests), width), dtype=np.int64)
            for row, request in enumerate(requests):
                ids[row, : lengths[row]] = request.prompt
            batch.logits = self._forward(batch, ids, lengths, np.arange(len(requests)) * width + lengths - 1)
            return batch
        rows = []
        for request in requests:  # one at a time, each in pieces of max_num_tokens when longer
            row = None
            while row is None or row.length < len(request.prompt):
                row = self.extend(row, request, self.max_num_tokens)
            rows.append(row)
        return self.merge(*rows)

    def extend(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Up to `budget` more prompt tokens of one request into its own 1-row batch (chunked context;
        GroupQueryAttention takes several tokens after a cache only at batch size 1)."""
        partial = self._empty_row(request) if partial is None else partial
        start = int(partial.lengths[0])
        chunk = request.prompt[start : start + budget]
        partial.lengths = np.array([start + len(chunk)])
        partial.logits = self._forward(partial, np.array([chunk]), partial.lengths, np.array([len(chunk) - 1]))
        return partial

    def _empty_row(self, request: Request) -> Batch:
        """A 1-row batch for `request` with an empty cache of the capacity it needs."""
        return Batch([request], self._buffers(1, self._capacity([request])), None, lengths=np.array([0]))

    def seed(self, request: Request, prefix: np.ndarray) -> Batch:
        """A 1-row batch whose cache starts with `prefix` ([past inputs, kv_heads, tokens, head_size], stored by
        `pipeline.targets.onnxruntime.runtime.kv_cache`): `extend` prefills the rest of the prompt after it."""
        partial = self._empty_row(request)
        for name, kv in zip(self.past_names, prefix):
            partial.past[name][0, :, : kv.shape[1]] = kv
        partial.lengths = np.array([prefix.shape[2]])
        return partial

    def export(self, batch: Batch, row: int, start: int, stop: int) -> np.ndarray:
        """A copy of row `row`'s K/V at positions [start, stop), [past inputs, kv_heads, positions, head_size]."""
        return np.stack([batch.past[name][row, :, start:stop] for name in self.past_names])

    def decode_step(self, batch: Batch) -> None:
        batch.lengths = batch.lengths + 1
        last = np.array([[r.last_token] for r in batch.requests], dtype=np.int64)
        batch.logits = self._forward(batch, last, batch.lengths, np.arange(len(batch)), prompt=False)

    def room(self, batch: Batch, row: int) -> int:
        """Positions left in the row's cache buffer (less the batch-invariant dummy token's)."""
        return next(iter(batch.past.values())).shape[2] - int(batch.lengths[row]) - self.spare_rows

    def verify(self, batch: Batch, row: int, tokens: list[int]) -> np.ndarray:
        """Run several tokens of one row after its cache (speculative drafts), on a 1-row view of the batch's
        buffers (row i of a C-contiguous [rows, ...] buffer is contiguous: wrapped, not copied); returns the
        logits after each token, [len(tokens), vocab]. The row's length grows by len(tokens)."""
        lengths = batch.lengths[row : row + 1] + len(tokens)
        logits = self._forward(batch, np.array([tokens]), lengths, np.arange(len(tokens)), row=row)
        batch.lengths[row] = lengths[0]
        return logits

    def select(self, batch: Batch, rows: list[int]) -> Batch:
        spare = [len(batch)] * self.spare_rows  # the spare row's content is never read: any row will do
        past = {name: buffer[rows + spare] for name, buffer in batch.past.items()}
        return Batch([batch.requests[i] for i in rows], past, batch.logits[rows], lengths=batch.lengths[rows])

    def merge(self, *batches: Batch) -> Batch:
        """Rows of all, in buffers of the largest capacity: one copy of each row, however many batches."""
        capacity = max(buffer.shape[2] for batch in batches for buffer in batch.past.values())
        merged = Batch(
            [r for batch in batches for r in batch.requests],
            self._buffers(sum(len(batch) for batch in batches), capacity),
            np.concatenate([batch.logits for batch in batches]),
            lengths=np.concatenate([batch.lengths for batch in batches]),
        )
        for name, buffer in merged.past.items():
            start = 0
            for batch in batches:
                source = batch.past[name]
                buffer[start : start + len(batch), :, : source.shape[2]] = source[: len(batch)]
                start += len(batch)
        return merged


def _numpy(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()
