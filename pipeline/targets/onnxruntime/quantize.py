"""Weight-only quantization of the exported ONNX graph into the engine's (the `onnxruntime` target's engine stage).

ONNX Runtime's MatMulNBits quantizer turns each linear layer's MatMul into int8 or int4 blocks (round-to-nearest with
the fast MLAS kernels, or HQQ's float zero points); lm_head is untied from the embedding first so it is quantized
too, int4 engines may keep some layers at 8 bits, and the token embedding may become a GatherBlockQuantized.
Why weight-only: the adapter's docstring; the measured defaults: docs/research/onnx-export-study.md.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.errors import BuildStepError
from pipeline.prequantized import QuantizedLinear
from pipeline.targets.onnxruntime import ONNX_NAME
from pipeline.targets.onnxruntime.external_data import Initializers
from pipeline.targets.onnxruntime.graph import fused_parts
from pipeline.targets.onnxruntime.smoothquant import Smoothing

INT8_BLOCK = 32  # int8 MatMulNBits block: with accuracy_level 4 it also sets the activation quantization block
BLOCK_SIZES = (32, 64, 128)  # MatMulNBits blocks measured here (docs/research/onnx-export-study.md)


def module_name(node_name: str) -> str:
    """'/model/layers.0/self_attn/q_proj/MatMul' -> 'model.layers.0.self_attn.q_proj' (the HF module name)."""
    return node_name.strip("/").rsplit("/", 1)[0].replace("/", ".")


def untie_lm_head(model, store: Initializers) -> bool:
    """Give lm_head its own (transposed) weight when it reads the tied embedding through a Transpose.

    optimum exports tied embeddings as MatMul(x, Transpose(embed_tokens)); a non-constant weight
    cannot be quantized, so without this the largest matmul of a small model stays fp32.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    head = next((n for n in model.graph.node if n.op_type == "MatMul" and module_name(n.name) == "lm_head"), None)
    transpose = producers.get(head.input[1]) if head is not None else None
    if transpose is None or transpose.op_type != "Transpose":
        return False
    store.put("lm_head.weight", store.array(transpose.input[0]).T)
    head.input[1] = "lm_head.weight"
    if not any(transpose.output[0] in n.input for n in model.graph.node):
        model.graph.node.remove(transpose)
    return True


def fuse(linears: Mapping[str, QuantizedLinear], parts: list[str]) -> QuantizedLinear:
    """The quantized parts of one graph matmul stacked along the output axis, as the graph stacks their weights;
    act-order parts must order their input rows alike (GPTQ's parts reading one input do)."""
    found = [linears[part] for part in parts]  # once each: an imported checkpoint's are unpacked on lookup
    first = found[0]
    for part, other in zip(parts[1:], found[1:]):
        same_rows = (first.g_idx is None) == (other.g_idx is None) and (
            first.g_idx is None or np.array_equal(first.g_idx, other.g_idx)
        )
        if not same_rows or (other.bits, other.group_size) != (first.bits, first.group_size):
            raise BuildStepError(
                f"{part} and {parts[0]} read one input but group it differently (act-order g_idx, bits or group size), "
                "so the engine cannot run them as one matmul; set quantization.checkpoint_quantization: dequantize"
            )
    stacked = {key: np.concatenate([getattr(linear, key) for linear in found]) for key in ("codes", "scales", "zeros")}
    return QuantizedLinear(**stacked, g_idx=first.g_idx, bits=first.bits, group_size=first.group_size)


def matmul_nbits(node, linear: QuantizedLinear, accuracy_level: int | None) -> tuple[list, list]:
    """MatMulNBits nodes and initializers holding `linear`'s codes, scales and zero points exactly (an act-order
    linear's input is gathered into group order first, so the fast contiguous-block kernels run it)."""
    import onnx
    from onnx import numpy_helper

    rows, columns = linear.codes.shape  # [N, K]
    size = columns if linear.group_size == -1 else linear.group_size
    block = next((b for b in (128, 64, 32, 16) if size % b == 0), None)
    if block is None:
        raise BuildStepError(
            f"{module_name(node.name)}: groups of {size} rows fit no MatMulNBits block (16, 32, 64 or 128); set "
            "quantization.checkpoint_quantization: dequantize"
        )
    name, x, nodes, codes = node.name, node.input[0], [], linear.codes
    if linear.g_idx is not None:
        order = np.argsort(linear.g_idx, kind="stable")
        if not np.array_equal(linear.g_idx[order], np.arange(columns) // size):
            raise BuildStepError(f"{module_name(name)}: act-order groups are not {size} rows each")
        codes = codes[:, order]
        permutation = numpy_helper.from_array(order.astype(np.int64), f"{name}_order")
        nodes.append(onnx.helper.make_node("Gather", [x, permutation.name], [f"{name}_ordered"], axis=-1))
        x, initializers = f"{name}_ordered", [permutation]
    else:
        initializers = []
    blocks = -(-columns // block)
    group_of_block = np.arange(blocks) * block // size
    padded = np.zeros((rows, blocks * block), np.uint8)
    padded[:, :columns] = codes
    if linear.bits == 4:
        padded = padded[:, ::2] | (padded[:, 1::2] << 4)  # the first of two values in the low nibble
    weight = numpy_helper.from_array(padded.reshape(rows, blocks, -1), f"{name}_B")
    scales = numpy_helper.from_array(linear.scales[:, group_of_block].astype(np.float32).ravel(), f"{name}_scales")
    inputs, initializers = [x, weight.name, scales.name], [*initializers, weight, scales]
    zeros = linear.zeros[:, group_of_block]
    if np.any(zeros != 2 ** (linear.bits - 1)):  # MatMulNBits' default zero point otherwise
        if linear.bits == 4:
            zeros = np.pad(zeros, ((0, 0), (0, blocks % 2)))
            zeros = zeros[:, ::2] | (zeros[:, 1::2] << 4)
        initializers.append(numpy_helper.from_array(zeros.astype(np.uint8).ravel(), f"{name}_zero_points"))
        inputs.append(initializers[-1].name)
    attributes = dict(K=columns, N=rows, bits=linear.bits, block_size=block)
    if accuracy_level:
        attributes["accuracy_level"] = accuracy_level
    nodes.append(
        onnx.helper.make_node(
            "MatMulNBits",
            inputs,
            list(node.output),
            name=f"{name}_Q{linear.bits}",
            domain="com.microsoft",
            **attributes,
        )
    )
    return nodes, initializers


def place_linears(
    model, linears: Mapping[str, QuantizedLinear], accuracy_level: int | None, add=None, only=None
) -> list[str]:
    """Replace every MatMul whose HF modules `linears` holds (and `only` names, when given) by MatMulNBits of their
    codes, each looked up once (an imported checkpoint's are unpacked from its file then); the names replaced.
    `add` puts each new initializer in the graph (default: as it is; `Initializers.add` writes its bytes out)."""
    import onnx

    add = add or model.graph.initializer.append

    replaced = []
    for node in list(model.graph.node):
        parts = fused_parts(module_name(node.name))
        if node.op_type != "MatMul" or not all(p in linears and (only is None or p in only) for p in parts):
            continue
        nodes, initializers = matmul_nbits(node, fuse(linears, parts), accuracy_level)
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        for offset, new in enumerate(nodes):
            model.graph.node.insert(index + offset, new)
        weight = next(i for i in model.graph.initializer if i.name == node.input[1])
        model.graph.initializer.remove(weight)
        for initializer in initializers:
            add(initializer)
        replaced.append(node.name)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return replaced


@dataclass(frozen=True)
class Rounding:
    """How one pass writes MatMulNBits weights; its fields, in this order, are also the engine report's."""

    method: str
    bits: int
    block_size: int
    symmetric: bool | None  # None: the zero points are the method's own (hqq's floats, placed codes' integers)
    accuracy_level: int | None

    @classmethod
    def resolve(
        cls,
        weights: str,
        method: str,
        group_size: int,
        symmetric: bool | None,
        accuracy_level: int | None,
        placing: bool,
    ) -> Rounding:
        """The settings with the measured defaults filled in: symmetric int8 and asymmetric int4, accuracy level 4
        (int8 activations inside MatMulNBits, the fast MLAS kernels); hqq's float zero points have no int8-compute
        kernel, and placed codes (`placing`) keep their own zero points."""
        bits = 8 if weights == "int8" else 4
        if placing:
            return cls(method, bits, group_size, None, 4 if accuracy_level is None else accuracy_level)
        if method == "hqq":
            return cls(method, bits, group_size, None, None)
        symmetric = weights == "int8" if symmetric is None else symmetric
        return cls(method, bits, group_size, symmetric, 4 if accuracy_level is None else accuracy_level)


INT8_KEPT = Rounding("rtn", 8, INT8_BLOCK, True, 4)  # the pass of an int4 engine's int8_modules


@dataclass(frozen=True)
class MatmulChoice:
    """Which pass writes each of the graph's matmuls: `excluded` ones stay float, `int8` ones (an int4 engine's
    int8_modules) get a pass of their own after the others, `resized` ones a block other than group_size."""

    matmuls: list[str]
    excluded: list[str]
    int8: list[str]
    resized: dict[str, int]

    @classmethod
    def of(cls, model, bits: int, exclude_modules, int8_modules, module_group_sizes) -> MatmulChoice:
        """The choice that quantize_graph's patterns over HF module names make; the first module_group_sizes
        pattern naming a matmul sets its block."""
        matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
        excluded = matching(matmuls, exclude_modules)
        candidates = [n for n in matmuls if n not in excluded]
        int8 = matching(candidates, int8_modules) if bits == 4 else []
        resized = {}
        for pattern, size in (module_group_sizes or {}).items():
            resized |= {n: size for n in matching(candidates, [pattern]) if n not in int8 and n not in resized}
        return cls(matmuls, excluded, int8, resized)

    def placed_modules(self, linears: Mapping[str, QuantizedLinear]) -> set[str]:
        """The modules of `linears` read by the matmuls that are neither excluded nor int8_modules (those are
        rounded)."""
        kept = {n for n in self.matmuls if n not in self.excluded and n not in self.int8}
        return {m for n in kept for m in fused_parts(module_name(n)) if m in linears}

    def rounding_passes(self, block_size: int) -> dict[int, list[str]]:
        """Block -> the matmuls rounded in it: `block_size`'s pass first, with every matmul not otherwise chosen."""
        passes = {
            block_size: [
                n for n in self.matmuls if n not in self.excluded and n not in self.int8 and n not in self.resized
            ]
        }
        for node, size in self.resized.items():
            passes.setdefault(size, []).append(node)
        return passes

    def report(self) -> dict:
        """The engine report's account of the choice."""
        return {"excluded_matmuls": self.excluded, "int8_matmuls": self.int8, "resized_blocks": dict(self.resized)}


def quantize_graph(
    export_dir: Path,
    out_dir: Path,
    *,
    weights: str,
    method: str = "rtn",
    group_size: int = 128,
    exclude_modules: list[str] | tuple[str, ...] = (),
    symmetric: bool | None = None,
    accuracy_level: int | None = None,
    quantize_embedding: bool = False,
    int8_modules: list[str] | tuple[str, ...] = (),
    linears: Mapping[str, QuantizedLinear] | None = None,
    smoothing: Smoothing | None = None,
    module_group_sizes: dict[str, int] | None = None,
) -> dict:
    """Write the engine's ONNX graph: fp32 as exported, or MatMulNBits int8/int4 weights.

    weights: "none" | "int8" | "int4"; method: "rtn" (round-to-nearest, fast MLAS kernels) or "hqq"
    (float zero points: most accurate at 4 bits, but no int8-compute kernel). group_size is the
    block size along K for int4; int8 uses it too. symmetric=None picks the measured default
    (int8: symmetric, int4: asymmetric); accuracy_level=None picks 4 (int8 activations inside
    MatMulNBits) for rtn. `exclude_modules` are fnmatch patterns over HF module names, e.g.
    ['lm_head', '*.down_proj']; lm_head is quantized unless excluded (a tied embedding is untied
    first, see `untie_lm_head`). quantize_embedding turns the token-embedding Gather into a 4-bit
    GatherBlockQuantized (ORT only has 4-bit Gather quantization).
    Measured defaults and their cost: docs/research/onnx-export-study.md. `linears` (HF module -> integer codes:
    GPTQ's, or an imported checkpoint's) are placed as they are instead of rounding the graph's weights; matmuls
    they lack stay float unless int8_modules names them. `smoothing` (method smoothquant) first moves the
    activations' outliers into the float weights (`smoothquant`), which are then rounded to nearest.
    `module_group_sizes` (fnmatch pattern over HF module names -> block) gives the modules it names another block
    than group_size; the first pattern that matches wins.
    """
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    if weights == "none":
        return copy_float_graph(export_dir, out_dir)
    check_weights(weights, method, linears)
    quiet_quantizer_log()
    model = onnx.load(str(export_dir / ONNX_NAME), load_external_data=False)  # each weight is read when it is quantized
    store = Initializers(model, export_dir, out_dir / ".unsaved.data")
    rounding = Rounding.resolve(weights, method, group_size, symmetric, accuracy_level, placing=linears is not None)
    chosen = MatmulChoice.of(model, rounding.bits, exclude_modules, int8_modules, module_group_sizes)
    untied = not any(module_name(n) == "lm_head" for n in chosen.excluded) and untie_lm_head(model, store)
    smoothed = smoothing.apply(model, store) if smoothing is not None else None
    placed = quantize_matmuls(store, chosen, rounding, linears)
    embedding_bits = None
    if quantize_embedding:
        embedding_bits = quantize_embedding_gather(store.model, rounding.bits, group_size, store)
    quantized = sum(1 for n in store.model.graph.node if n.op_type == "MatMulNBits")
    store.save(out_dir / ONNX_NAME)
    onnx.checker.check_model(str(out_dir / ONNX_NAME))
    return {
        "weights": weights,
        **asdict(rounding),
        "quantized_matmuls": quantized,
        "placed_matmuls": placed,
        **chosen.report(),
        "lm_head_untied": untied,
        "embedding_bits": embedding_bits,
        **({"smoothquant": smoothed} if smoothed else {}),
        "engine_bytes": engine_bytes(out_dir),
    }


def copy_float_graph(export_dir: Path, out_dir: Path) -> dict:
    """weights none: the engine is the exported fp32 graph as it is, so its files are copied, not rewritten."""
    for file in export_dir.glob("model.onnx*"):
        shutil.copy2(file, out_dir / file.name)
    return {"weights": "fp32", "engine_bytes": engine_bytes(out_dir), "quantized_matmuls": 0}


def engine_bytes(out_dir: Path) -> int:
    """The size of the engine's graph and weights, for the build report."""
    return sum(f.stat().st_size for f in out_dir.glob("model.onnx*"))


def check_weights(weights: str, method: str, linears: Mapping[str, QuantizedLinear] | None) -> None:
    """Refuse weights this target has no kernel for, and rounding methods it has no quantizer for (placed codes
    need none), before any graph is read."""
    if weights not in ("int8", "int4"):
        raise BuildStepError(f"onnxruntime target supports weights none/int8/int4, not {weights!r}")
    if method not in ("rtn", "hqq", "smoothquant") and linears is None:
        raise BuildStepError(f"onnxruntime target rounds weights with rtn, smoothquant or hqq, not {method!r}")


def quiet_quantizer_log() -> None:
    """Keep ONNX Runtime's MatMulNBits quantizer to warnings: it logs one INFO line per node, and importing it sets
    logging up at INFO, so the level is lowered after the import."""
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)


def matching(matmuls: list[str], patterns) -> list[str]:
    """The `matmuls` whose HF module name matches one of the fnmatch `patterns`, in graph order."""
    return [n for n in matmuls if any(fnmatch.fnmatchcase(module_name(n), p) for p in patterns)]


def quantize_matmuls(
    store: Initializers, chosen: MatmulChoice, rounding: Rounding, linears: Mapping[str, QuantizedLinear] | None
) -> int:
    """Turn the chosen matmuls into MatMulNBits: `linears`' codes placed as they are, or the graph's weights rounded
    (one pass per block), then an int4 engine's int8_modules rounded in a pass of their own; the number placed."""
    if linears is not None:
        only = chosen.placed_modules(linears)
        placed = len(place_linears(store.model, linears, rounding.accuracy_level, store.add, only))
    else:
        placed = 0
        for size, nodes in chosen.rounding_passes(rounding.block_size).items():
            round_matmuls(store, chosen.matmuls, nodes, replace(rounding, block_size=size))
    if chosen.int8:
        round_matmuls(store, chosen.matmuls, chosen.int8, INT8_KEPT)
    return placed


def round_matmuls(store: Initializers, matmuls: list[str], nodes: list[str], rounding: Rounding) -> None:
    """Round the weights of `nodes` into MatMulNBits with ONNX Runtime's quantizer, one weight in memory at a time;
    the graph's other `matmuls` are left as they are (its nodes_to_include alone does not limit it)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    size, bits = rounding.block_size, rounding.bits
    config = (
        HQQWeightOnlyQuantConfig(block_size=size, bits=bits)
        if rounding.method == "hqq"
        else DefaultWeightOnlyQuantConfig(
            block_size=size, is_symmetric=rounding.symmetric, bits=bits, accuracy_level=rounding.accuracy_level
        )
    )
    quantizer = MatMulNBitsQuantizer(
        store.model,
        bits=bits,
        block_size=size,
        is_symmetric=bool(rounding.symmetric),
        accuracy_level=rounding.accuracy_level,
        nodes_to_exclude=[n for n in matmuls if n not in nodes],
        algo_config=config,
    )
    one_weight_at_a_time(quantizer, store).process()
    store.model = quantizer.model.model


def one_weight_at_a_time(quantizer, store: Initializers):
    """`quantizer` (ONNX Runtime's MatMulNBitsQuantizer) with each node's weight read just before the node is
    quantized and its results written out just after, so that it never holds the model's weights."""
    quantize = quantizer.node_quantizer.quantize

    def one_node(node, graph_stack):
        weights = store.scratch_graph(node.input)
        if not weights.initializer:
            return quantize(node, graph_stack)
        nodes = quantize(node, [weights])
        store.take_new(weights, node.input)
        return nodes

    quantizer.node_quantizer.quantize = one_node
    return quantizer


def quantize_embedding_gather(model, bits: int, block_size: int, store: Initializers) -> int | None:
    """Replace the token-embedding Gather (constant table) by GatherBlockQuantized.

    8 bits: symmetric uint8 (zero point 128, ORT's default when none is given), one scale per
    `block_size` values of a row; 4 bits: ORT's asymmetric uint4 quantizer.
    """
    import numpy as np
    import onnx

    initializers = {i.name: i for i in model.graph.initializer}
    node = next(
        (
            n
            for n in model.graph.node
            if n.op_type == "Gather" and n.input[0] in initializers and module_name(n.name).endswith("embed_tokens")
        ),
        None,
    )
    if node is None:
        return None
    table = initializers[node.input[0]]
    if bits == 8:
        weight = store.array(table.name).astype(np.float32)
        rows, cols = weight.shape
        blocks = weight.reshape(rows, cols // block_size, block_size)
        scales = np.abs(blocks).max(axis=-1) / 127.0
        scales[scales == 0] = 1.0
        quantized = (np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128).astype(np.uint8).reshape(rows, cols)
        data, scale = table.name + "_Q8", table.name + "_scales"
        store.put(data, quantized)
        store.put(scale, scales.astype(np.float32))
        del weight, blocks, quantized
        new_nodes = [
            onnx.helper.make_node(
                "GatherBlockQuantized",
                [data, node.input[1], scale],
                [node.output[0]],
                name=node.name + "_Q8",
                domain="com.microsoft",
                bits=8,
                block_size=block_size,
                gather_axis=0,
                quantize_axis=1,
            )
        ]
    else:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(
            block_size=block_size, is_symmetric=False, bits=4, op_types_to_quantize=("Gather",)
        )
        weights = store.scratch_graph([table.name])
        new_nodes = DefaultWeightOnlyQuantizer(config).quantize_gather(node, [weights])
        store.take_new(weights, [table.name])
    index = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for offset, new in enumerate(new_nodes):
        model.graph.node.insert(index + offset, new)
    if not any(table.name in n.input for n in model.graph.node):
        model.graph.initializer.remove(table)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return bits
