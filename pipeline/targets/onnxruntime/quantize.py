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

from pipeline.errors import BuildStepError
from pipeline.targets.onnxruntime import ONNX_NAME

INT8_BLOCK = 32  # int8 MatMulNBits block: with accuracy_level 4 it also sets the activation quantization block
BLOCK_SIZES = (32, 64, 128)  # MatMulNBits blocks measured here (docs/research/onnx-export-study.md)


def module_name(node_name: str) -> str:
    """'/model/layers.0/self_attn/q_proj/MatMul' -> 'model.layers.0.self_attn.q_proj' (the HF module name)."""
    return node_name.strip("/").rsplit("/", 1)[0].replace("/", ".")


def untie_lm_head(model) -> bool:
    """Give lm_head its own (transposed) weight when it reads the tied embedding through a Transpose.

    optimum exports tied embeddings as MatMul(x, Transpose(embed_tokens)); a non-constant weight
    cannot be quantized, so without this the largest matmul of a small model stays fp32.
    """
    import numpy as np
    from onnx import numpy_helper

    producers = {out: node for node in model.graph.node for out in node.output}
    head = next((n for n in model.graph.node if n.op_type == "MatMul" and module_name(n.name) == "lm_head"), None)
    transpose = producers.get(head.input[1]) if head is not None else None
    if transpose is None or transpose.op_type != "Transpose":
        return False
    embedding = next(i for i in model.graph.initializer if i.name == transpose.input[0])
    model.graph.initializer.append(
        numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(embedding).T), "lm_head.weight")
    )
    head.input[1] = "lm_head.weight"
    if not any(transpose.output[0] in n.input for n in model.graph.node):
        model.graph.node.remove(transpose)
    return True


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
) -> dict:
    """Write the engine's ONNX graph: fp32 as exported, or MatMulNBits weight-only int8/int4.

    weights: "none" | "int8" | "int4"; method: "rtn" (round-to-nearest, fast MLAS kernels) or "hqq"
    (float zero points: most accurate at 4 bits, but no int8-compute kernel). group_size is the
    block size along K for int4; int8 uses it too. symmetric=None picks the measured default
    (int8: symmetric, int4: asymmetric); accuracy_level=None picks 4 (int8 activations inside
    MatMulNBits) for rtn. `exclude_modules` are fnmatch patterns over HF module names, e.g.
    ['lm_head', '*.down_proj']; lm_head is quantized unless excluded (a tied embedding is untied
    first, see `untie_lm_head`). quantize_embedding turns the token-embedding Gather into a 4-bit
    GatherBlockQuantized (ORT only has 4-bit Gather quantization).
    Measured defaults and their cost: docs/research/onnx-export-study.md.
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
    if method not in ("rtn", "hqq"):
        raise BuildStepError(f"onnxruntime target supports method rtn/hqq, not {method!r}")

    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
        logging.WARNING
    )  # one INFO line per node
    model = onnx.load(str(source))
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    excluded = [n for n in matmuls if any(fnmatch.fnmatchcase(module_name(n), p) for p in exclude_modules)]
    untied = not any(module_name(n) == "lm_head" for n in excluded) and untie_lm_head(model)
    bits = 8 if weights == "int8" else 4
    block = group_size
    if symmetric is None:
        symmetric = weights == "int8"
    if method == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=block, bits=bits)
        accuracy_level = None  # float zero points: no int8-compute kernel
        symmetric = None
    else:
        accuracy_level = 4 if accuracy_level is None else accuracy_level  # 4: int8 activations, the fast MLAS kernels
        config = DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=symmetric, bits=bits, accuracy_level=accuracy_level
        )
    # int4 builds may keep some modules at 8 bits (second pass below); the first pass leaves them alone.
    eight = (
        [n for n in matmuls if n not in excluded and any(fnmatch.fnmatchcase(module_name(n), p) for p in int8_modules)]
        if bits == 4
        else []
    )
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block,
        is_symmetric=bool(symmetric),
        accuracy_level=accuracy_level,
        nodes_to_exclude=excluded + eight,
        algo_config=config,
    )
    quantizer.process()
    model = quantizer.model.model
    if eight:
        config8 = DefaultWeightOnlyQuantConfig(block_size=INT8_BLOCK, is_symmetric=True, bits=8, accuracy_level=4)
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=8,
            block_size=INT8_BLOCK,
            is_symmetric=True,
            accuracy_level=4,
            nodes_to_include=eight,
            algo_config=config8,
        )
        quantizer.process()
        model = quantizer.model.model
    embedding_bits = None
    if quantize_embedding:
        embedding_bits = quantize_embedding_gather(model, bits, block)
    quantized = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    onnx.save(
        model,
        str(out_dir / ONNX_NAME),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=ONNX_NAME + ".data",
        size_threshold=1024,
    )
    onnx.checker.check_model(str(out_dir / ONNX_NAME))
    return {
        "weights": weights,
        "method": method,
        "bits": bits,
        "block_size": block,
        "symmetric": symmetric,
        "accuracy_level": accuracy_level,
        "quantized_matmuls": quantized,
        "excluded_matmuls": excluded,
        "int8_matmuls": eight,
        "lm_head_untied": untied,
        "embedding_bits": embedding_bits,
        "engine_bytes": sum(f.stat().st_size for f in out_dir.glob("model.onnx*")),
    }


def quantize_embedding_gather(model, bits: int, block_size: int) -> int | None:
    """Replace the token-embedding Gather (constant table) by GatherBlockQuantized.

    8 bits: symmetric uint8 (zero point 128, ORT's default when none is given), one scale per
    `block_size` values of a row; 4 bits: ORT's asymmetric uint4 quantizer.
    """
    import numpy as np
    import onnx
    from onnx import numpy_helper

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
        weight = numpy_helper.to_array(table).astype(np.float32)
        rows, cols = weight.shape
        blocks = weight.reshape(rows, cols // block_size, block_size)
        scales = np.abs(blocks).max(axis=-1) / 127.0
        scales[scales == 0] = 1.0
        quantized = (np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128).astype(np.uint8).reshape(rows, cols)
        data = numpy_helper.from_array(quantized, table.name + "_Q8")
        scale = numpy_helper.from_array(scales.astype(np.float32), table.name + "_scales")
        model.graph.initializer.extend([data, scale])
        new_nodes = [
            onnx.helper.make_node(
                "GatherBlockQuantized",
                [data.name, node.input[1], scale.name],
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
        new_nodes = DefaultWeightOnlyQuantizer(config).quantize_gather(node, [model.graph])
    index = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for offset, new in enumerate(new_nodes):
        model.graph.node.insert(index + offset, new)
    if not any(table.name in n.input for n in model.graph.node):
        model.graph.initializer.remove(table)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return bits
