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


def fuse(linears: dict[str, QuantizedLinear], parts: list[str]) -> QuantizedLinear:
    """The quantized parts of one graph matmul stacked along the output axis, as the graph stacks their weights;
    act-order parts must order their input rows alike (GPTQ's parts reading one input do)."""
    first = linears[parts[0]]
    for part in parts[1:]:
        other = linears[part]
        same_rows = (first.g_idx is None) == (other.g_idx is None) and (
            first.g_idx is None or np.array_equal(first.g_idx, other.g_idx)
        )
        if not same_rows or (other.bits, other.group_size) != (first.bits, first.group_size):
            raise BuildStepError(
                f"{part} and {parts[0]} read one input but group it differently (act-order g_idx, bits or group size), "
                "so the engine cannot run them as one matmul; set quantization.checkpoint_quantization: dequantize"
            )
    stacked = {
        key: np.concatenate([getattr(linears[part], key) for part in parts]) for key in ("codes", "scales", "zeros")
    }
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


def place_linears(model, linears: dict[str, QuantizedLinear], accuracy_level: int | None, add=None) -> list[str]:
    """Replace every MatMul whose HF modules `linears` holds by MatMulNBits of their codes; the names replaced.
    `add` puts each new initializer in the graph (default: as it is; `Initializers.add` writes its bytes out)."""
    import onnx

    add = add or model.graph.initializer.append

    replaced = []
    for node in list(model.graph.node):
        if node.op_type != "MatMul" or not all(p in linears for p in fused_parts(module_name(node.name))):
            continue
        nodes, initializers = matmul_nbits(node, fuse(linears, fused_parts(module_name(node.name))), accuracy_level)
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
    linears: dict[str, QuantizedLinear] | None = None,
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

    source = export_dir / ONNX_NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights == "none":
        for file in export_dir.glob("model.onnx*"):
            shutil.copy2(file, out_dir / file.name)
        return {
            "weights": "fp32",
            "engine_bytes": sum(f.stat().st_size for f in out_dir.glob("model.onnx*")),
            "quantized_matmuls": 0,
        }
    if weights not in ("int8", "int4"):
        raise BuildStepError(f"onnxruntime target supports weights none/int8/int4, not {weights!r}")
    if method not in ("rtn", "hqq", "smoothquant") and linears is None:
        raise BuildStepError(f"onnxruntime target rounds weights with rtn, smoothquant or hqq, not {method!r}")

    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
        logging.WARNING
    )  # one INFO line per node
    model = onnx.load(str(source), load_external_data=False)  # each weight is read when it is quantized
    store = Initializers(model, export_dir, out_dir / ".unsaved.data")
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    excluded = [n for n in matmuls if any(fnmatch.fnmatchcase(module_name(n), p) for p in exclude_modules)]
    untied = not any(module_name(n) == "lm_head" for n in excluded) and untie_lm_head(model, store)
    smoothed = smoothing.apply(model, store) if smoothing is not None else None
    bits = 8 if weights == "int8" else 4
    block = group_size
    if symmetric is None:
        symmetric = weights == "int8"
    if linears is not None:
        accuracy_level = 4 if accuracy_level is None else accuracy_level
        symmetric = None  # as the codes have it
    elif method == "hqq":
        accuracy_level = None  # float zero points: no int8-compute kernel
        symmetric = None
    else:
        accuracy_level = 4 if accuracy_level is None else accuracy_level  # 4: int8 activations, the fast MLAS kernels

    def matching(patterns) -> list[str]:
        return [
            n for n in matmuls if n not in excluded and any(fnmatch.fnmatchcase(module_name(n), p) for p in patterns)
        ]

    # int4 builds may keep some modules at 8 bits (a pass of their own below); the first passes leave them alone.
    eight = matching(int8_modules) if bits == 4 else []
    resized = {}  # matmul -> its block, where module_group_sizes names one other than group_size (first pattern)
    for pattern, size in (module_group_sizes or {}).items():
        resized |= {n: size for n in matching([pattern]) if n not in eight and n not in resized}
    if linears is not None:
        kept = {n for n in matmuls if n not in excluded and n not in eight}
        placed = place_linears(
            model,
            {m: linears[m] for n in kept for m in fused_parts(module_name(n)) if m in linears},
            accuracy_level,
            store.add,
        )
    else:
        placed = []
        passes = {block: [n for n in matmuls if n not in excluded and n not in eight and n not in resized]}
        for node, size in resized.items():
            passes.setdefault(size, []).append(node)
        for size, nodes in passes.items():
            config = (
                HQQWeightOnlyQuantConfig(block_size=size, bits=bits)
                if method == "hqq"
                else DefaultWeightOnlyQuantConfig(
                    block_size=size, is_symmetric=symmetric, bits=bits, accuracy_level=accuracy_level
                )
            )
            quantizer = MatMulNBitsQuantizer(
                model,
                bits=bits,
                block_size=size,
                is_symmetric=bool(symmetric),
                accuracy_level=accuracy_level,
                nodes_to_exclude=[n for n in matmuls if n not in nodes],  # nodes_to_include alone does not limit it
                algo_config=config,
            )
            one_weight_at_a_time(quantizer, store).process()
            model = store.model = quantizer.model.model
    if eight:
        config8 = DefaultWeightOnlyQuantConfig(block_size=INT8_BLOCK, is_symmetric=True, bits=8, accuracy_level=4)
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=8,
            block_size=INT8_BLOCK,
            is_symmetric=True,
            accuracy_level=4,
            nodes_to_exclude=[n for n in matmuls if n not in eight],  # the excluded ones stay float
            algo_config=config8,
        )
        one_weight_at_a_time(quantizer, store).process()
        model = store.model = quantizer.model.model
    embedding_bits = None
    if quantize_embedding:
        embedding_bits = quantize_embedding_gather(model, bits, block, store)
    quantized = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    store.save(out_dir / ONNX_NAME)
    onnx.checker.check_model(str(out_dir / ONNX_NAME))
    return {
        "weights": weights,
        "method": method,
        "bits": bits,
        "block_size": block,
        "symmetric": symmetric,
        "accuracy_level": accuracy_level,
        "quantized_matmuls": quantized,
        "placed_matmuls": len(placed),
        "excluded_matmuls": excluded,
        "int8_matmuls": eight,
        "resized_blocks": dict(resized),
        "lm_head_untied": untied,
        "embedding_bits": embedding_bits,
        **({"smoothquant": smoothed} if smoothed else {}),
        "engine_bytes": sum(f.stat().st_size for f in out_dir.glob("model.onnx*")),
    }


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
