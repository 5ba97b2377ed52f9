"""Multi-LoRA on the fused graph: adapters resident in slots, every row of a batch applying its own (or none).

Graph side (`pipeline/targets/onnxruntime/graph.py`): each fused linear (qkv, o, gate_up, down) whose parts the
engine carries LoRA on gets four nodes,
    out += Where(mask, x @ A, 0) @ B
A [in, k x width] holding the A of the k slots the pass binds side by side, B [k x width, out] their B stacked (a
slot's block holding its parts' B on the diagonal, so q, k and v are one GEMM pair), and the mask [rows, 1,
k x width] true on the columns of the row's slot: two GEMMs a branch whatever the batch and its adapters. The base
weights stay quantized; the branch runs in float32.

One row's values never reach another's: the Where leaves exact zeros in other slots' columns (a multiply by the
mask would not: 0 x inf is NaN), and the slots only ever hold finite weights (the second GEMM multiplies every
row's zeros by every bound slot's B). A row whose own values overflow gets non-finite logits, and the runner fails
that request alone (`ModelRunner.sample`).

Runner side (`LoraSlots`): the slots are numpy buffers [max_loras, ...]. A pass binds the contiguous slot range its
rows use: B's range is a view; A's, whose columns are not contiguous, a copy made when the range or a slot in it
changes (a request with another adapter joining or the last one leaving), kept while it holds. A pass without
adapters binds zero-width weights, so the branch multiplies nothing. Adapters are registered once (host copies); one
is copied into a slot when a row needs it and no slot holds it, evicting the least recently used slot no running row
holds, as TensorRT-LLM's LoRA cache and vLLM's max_loras do.

Measured before this layout (`bench lora`, SmolLM2-135M int8, 2026-11-26): a branch over [k, 1, in, width] slots
against [rows, seq, in] (five nodes, k x rows small GEMMs summed) cost 1.50x the base step at batch 8 with 4
adapters; one over the pass's tokens ([tokens, in] against [k, in, width], seven nodes with its reshapes) 1.52x and
1.29x at batch 1 with none: the branch's node count, more than its bytes, sets its price.
Written by hand: ONNX Runtime has no multi-LoRA operator for CPU (onnxruntime-genai's adapters are one per session).
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.models import ModelFacts
from pipeline.peft_adapters import Adapter, Fit, load, module_shapes

# The graph's fused linears and the HF modules each concatenates along its output, in order.
BRANCHES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def input_names(layer: int, branch: str) -> tuple[str, str]:
    return f"lora.{layer}.{branch}.a", f"lora.{layer}.{branch}.b"


def mask_name(parts: int) -> str:
    """The mask of the branches of `parts` parts (slots parts x max_lora_rank wide): bool [rows, 1, k x width]."""
    return f"lora_mask.{parts}"


def branch_parts(target_modules: list[str]) -> dict[str, tuple[str, ...]]:
    """Per branch, the parts the engine carries LoRA on (branches without any are left out)."""
    parts = {branch: tuple(m for m in modules if m in target_modules) for branch, modules in BRANCHES.items()}
    return {branch: modules for branch, modules in parts.items() if modules}


@dataclass(frozen=True)
class LoraSpec:
    """What the engine was built with (config.json `lora`): the modules carrying LoRA and the limits."""

    target_modules: list[str]
    max_lora_rank: int
    max_loras: int

    @classmethod
    def from_engine(cls, config: dict) -> "LoraSpec | None":
        lora = config.get("lora")
        return None if lora is None else cls(lora["target_modules"], lora["max_lora_rank"], lora["max_loras"])

    def fit(self, facts: ModelFacts) -> Fit:
        return Fit(facts, self.max_lora_rank, self.target_modules)


class AdapterUnavailable(ValueError):
    """An adapter a queued request names can no longer go into a slot (unloaded, or its weights are not finite): that
    request fails, no other row is touched."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def engine_facts(config: dict) -> ModelFacts:
    """The model's sizes as an engine's config.json (`pretrained_config`) records them."""
    pretrained = config["pretrained_config"]
    keys = (
        "architecture",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    )
    head_size = pretrained.get("head_size") or pretrained["hidden_size"] // pretrained["num_attention_heads"]
    return ModelFacts(**{key: pretrained[key] for key in keys}, head_dim=head_size)


def engine_fit(engine_dir: Path) -> Fit | None:
    """What the engine in `engine_dir` takes of an adapter (None: it was built without LoRA)."""
    config = json.loads((Path(engine_dir) / "config.json").read_text())
    spec = LoraSpec.from_engine(config)
    return None if spec is None else spec.fit(engine_facts(config))


def check_names(lora: "LoraSlots | None", names: list[str | None], engine: str) -> None:
    """Refuse rows naming adapters (None: the base model) that `lora`, the LoRA of `engine`, cannot serve together:
    an engine without LoRA, an unknown adapter, more distinct ones than max_loras (they could never run)."""
    named = {name for name in names if name is not None}
    if named and lora is None:
        raise ValueError(f"{engine} was built without LoRA: selecting an adapter needs an engine with a lora section")
    unknown = sorted(named - set(lora.adapters)) if named else []
    if unknown:
        raise ValueError(f"unknown LoRA adapter {unknown[0]!r}; known: {lora.names}")
    if named and len(named) > lora.spec.max_loras:
        raise ValueError(
            f"the rows use {len(named)} LoRA adapters, more than the engine's max_loras {lora.spec.max_loras}"
        )


def task_adapters(lora: "LoraSlots | None", task_ids: list[int], engine: str) -> list[str | None]:
    """Each row's adapter from its Triton `lora_task_id` (0: the base model), checked as `check_names` does."""
    if any(task_ids) and lora is None:
        check_names(None, ["?"], engine)
    unknown = [t for t in task_ids if t and t not in lora.task_names] if any(task_ids) else []
    if unknown and unknown[0] in lora.failed:
        raise ValueError(lora.failed[unknown[0]])
    if unknown:
        known = ", ".join(f"{i} ({n})" for i, n in sorted(lora.task_names.items())) or "none"
        raise ValueError(f"lora_task_id {unknown[0]} names no loaded LoRA adapter; loaded: {known}")
    names = [lora.task_names[t] if t else None for t in task_ids]
    check_names(lora, names, engine)
    return names


class LoraSlots:
    """The adapters a runner knows (by name) and the `max_loras` slots they are applied from."""

    def __init__(self, spec: LoraSpec, facts: ModelFacts, max_registered: int | None = None):
        self.spec, self.facts = spec, facts
        self.max_registered = max_registered  # lora.max_cpu_loras: host copies kept (None: no bound)
        shapes, rank = module_shapes(facts), spec.max_lora_rank
        self.parts = branch_parts(spec.target_modules)
        self.a, self.b = {}, {}  # input name -> buffer [max_loras, in, width] / [max_loras, width, out]
        for layer in range(facts.num_hidden_layers):
            for branch, parts in self.parts.items():
                a_name, b_name = input_names(layer, branch)
                fan_in = shapes[parts[0]][0]
                fan_out = sum(shapes[m][1] for m in BRANCHES[branch])
                self.a[a_name] = np.zeros((spec.max_loras, fan_in, len(parts) * rank), np.float32)
                self.b[b_name] = np.zeros((spec.max_loras, len(parts) * rank, fan_out), np.float32)
        self.adapters: dict[str, Adapter] = {}
        self.task_names: dict[int, str] = {}  # Triton lora_task_id -> adapter name
        self.failed: dict[int, str] = {}  # lora_task_id -> why its adapter could not be served
        self.registrations: dict[str, int] = {}  # name -> which registration of the runner it is (`identity`)
        self._serial = itertools.count(1)
        self.slot_of: dict[str, int] = {}
        self.holders = [0] * spec.max_loras  # running rows per slot
        self.recent: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(spec.max_loras))
        self._views: dict[tuple[int, int], dict] = {}  # slot range -> its weight inputs (A's a copy)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def slot_bytes(self) -> int:
        """Memory one resident adapter takes (its slot in every branch)."""
        return sum(buffer.nbytes for buffer in [*self.a.values(), *self.b.values()]) // self.spec.max_loras

    def check(self, name: str, adapter: Adapter | Path, task_id: int | None = None) -> Adapter:
        """The adapter read and checked for this engine. Raises ValueError naming what does not fit it, or a task id
        another adapter has."""
        from pipeline.errors import PipelineError
        from pipeline.peft_adapters import problems

        if task_id is not None and self.task_names.get(task_id, name) != name:
            raise ValueError(f"lora_task_id {task_id} is adapter {self.task_names[task_id]!r}'s; pick another")
        if name not in self.adapters and self.max_registered is not None and len(self.adapters) >= self.max_registered:
            raise ValueError(
                f"LoRA adapter {name!r}: {len(self.adapters)} adapters are registered, lora.max_cpu_loras is "
                f"{self.max_registered}; unload one or raise lora.max_cpu_loras"
            )
        try:  # the header first: shapes that do not fit are refused before a tensor is read
            adapter = load(adapter, self.spec.fit(self.facts)) if isinstance(adapter, Path) else adapter
        except PipelineError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        found = problems(adapter, self.facts, self.spec.max_lora_rank, self.spec.target_modules)
        if found:
            raise ValueError(f"LoRA adapter {name!r} ({adapter.path}): {'; '.join(found)}")
        return adapter

    def register(self, name: str, adapter: Adapter | Path, task_id: int | None = None) -> None:
        """Make `name` servable (and its Triton `lora_task_id`, when given); see `check` for what raises. Not while
        a pass runs: it may rewrite a resident slot (the scheduler calls it between steps)."""
        adapter = self.check(name, adapter, task_id)
        self.adapters[name] = adapter
        self.registrations[name] = next(self._serial)
        if task_id is not None:
            self.task_names[task_id] = name
            self.failed.pop(task_id, None)
        if name in self.slot_of:  # re-registered: the resident copy is stale
            self._write(self.slot_of[name], adapter)

    def identity(self, name: str) -> str:
        """The adapter `name` as registered now: a name registered again (other weights) is another identity."""
        return f"{name}#{self.registrations[name]}"

    def unregister(self, name: str) -> None:
        """Stop serving `name`; rows running on its slot finish with it (the slot is free once they release it).
        Not while a pass runs, as `register`."""
        self.adapters.pop(name, None)
        self.slot_of.pop(name, None)
        for task_id in [t for t, n in self.task_names.items() if n == name]:
            del self.task_names[task_id]

    def acquire(self, names: list[str | None]) -> list[int | None] | None:
        """Slots for rows using adapters `names` (None: no adapter), loading those not resident; None when they
        need more slots than are free of running rows (the rows wait). Raises AdapterUnavailable for a name no longer
        registered or one whose weights are not finite."""
        unknown = [n for n in names if n is not None and n not in self.adapters]
        if unknown:
            raise AdapterUnavailable(unknown[0], f"LoRA adapter {unknown[0]!r} was unloaded before the request ran")
        wanted = {n for n in names if n is not None}
        missing = [n for n in wanted if n not in self.slot_of]
        free = [s for s in self.recent if not self.holders[s] and self._resident(s) not in wanted]
        if len(missing) > len(free):
            return None
        for name in missing:
            self._check_finite(name)
        for name, slot in zip(missing, free):
            evicted = self._resident(slot)
            if evicted is not None:
                del self.slot_of[evicted]
            self._write(slot, self.adapters[name])
            self.slot_of[name] = slot
        slots = [None if n is None else self.slot_of[n] for n in names]
        for slot in slots:
            if slot is not None:
                self.holders[slot] += 1
                self.recent.move_to_end(slot)
        return slots

    def hold(self, requests: list) -> bool:
        """Slots for the requests' adapters (`Request.adapter`), held until `release`; False (nothing held) when they
        need more slots than running rows leave free: the requests wait."""
        names = [request.adapter for request in requests]
        slots = self.acquire(names) if any(names) else [None] * len(requests)
        for request, slot in zip(requests, slots or []):
            request.lora_slot = slot
        return slots is not None

    def release(self, requests: list) -> None:
        for request in requests:
            if request.lora_slot is not None:
                self.holders[request.lora_slot] -= 1
                request.lora_slot = None

    def _check_finite(self, name: str) -> None:
        """The slots only ever hold finite weights: a branch's GEMM sums every bound slot's columns for every row
        (masked to exact zeros), and 0 x NaN is NaN, so one slot's NaN would reach every row of the pass."""
        for (layer, module), pair in self.adapters[name].weights.items():
            for half, weight in zip("AB", pair):
                if not np.isfinite(weight).all():
                    raise AdapterUnavailable(
                        name,
                        f"LoRA adapter {name!r} holds non-finite weights (layer {layer} {module} lora_{half}); "
                        "it is no longer served",
                    )

    def _resident(self, slot: int) -> str | None:
        return next((name for name, s in self.slot_of.items() if s == slot), None)

    def _write(self, slot: int, adapter: Adapter) -> None:
        """Copy the adapter into `slot` of every branch: A parts side by side, B parts on the block diagonal, each
        part's rank padded to max_lora_rank with zeros (exact: zero columns add nothing)."""
        rank, shapes = self.spec.max_lora_rank, module_shapes(self.facts)
        for layer in range(self.facts.num_hidden_layers):
            for branch, parts in self.parts.items():
                a_name, b_name = input_names(layer, branch)
                a, b = self.a[a_name][slot], self.b[b_name][slot]
                a[:], b[:] = 0, 0
                self._views = {bounds: v for bounds, v in self._views.items() if not bounds[0] <= slot < bounds[1]}
                offsets = np.cumsum([0] + [shapes[m][1] for m in BRANCHES[branch]])
                for index, module in enumerate(parts):
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    lora_a, lora_b = pair  # [r, in], [out, r] (scale folded in)
                    column = BRANCHES[branch].index(module)
                    r = lora_a.shape[0]
                    a[:, index * rank : index * rank + r] = lora_a.T
                    b[index * rank : index * rank + r, offsets[column] : offsets[column + 1]] = lora_b.T

    def feeds(self, slots: list[int | None]) -> tuple[tuple[int, int], dict[str, np.ndarray]]:
        """The slot range [lo, hi) a pass over rows using `slots` (None: no adapter) binds (empty when no row uses
        one), and its masks, one per branch width."""
        used = [s for s in slots if s is not None]
        lo, hi = (min(used), max(used) + 1) if used else (0, 0)
        masks = {}
        for parts in sorted({len(p) for p in self.parts.values()}):
            width = parts * self.spec.max_lora_rank
            mask = np.zeros((len(slots), 1, (hi - lo) * width), bool)
            for row, slot in enumerate(slots):
                if slot is not None:
                    mask[row, 0, (slot - lo) * width : (slot - lo + 1) * width] = True
            masks[mask_name(parts)] = mask
        return (lo, hi), masks

    def weights(self, bounds: tuple[int, int]) -> dict[str, np.ndarray]:
        """The weight inputs of the slot range [lo, hi): A [in, k x width] (a copy, kept until a slot in the range
        changes), B [k x width, out] (a view)."""
        if bounds not in self._views:
            lo, hi = bounds
            a = {
                name: np.ascontiguousarray(buffer[lo:hi].transpose(1, 0, 2).reshape(buffer.shape[1], -1))
                for name, buffer in self.a.items()
            }
            b = {name: buffer[lo:hi].reshape(-1, buffer.shape[2]) for name, buffer in self.b.items()}
            self._views[bounds] = a | b
        return self._views[bounds]

    def slot_feeds(self, slot: int, rows: int) -> dict[str, np.ndarray]:
        """The LoRA inputs of a plain `session.run` over `rows` rows that all use `slot` (the quality gate's)."""
        bounds, masks = self.feeds([slot] * rows)
        return self.weights(bounds) | masks
