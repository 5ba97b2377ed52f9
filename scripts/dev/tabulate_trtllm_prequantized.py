"""Tabulate which already-quantized Hugging Face checkpoints (config.json `quantization_config` with quant_method
gptq, awq or compressed-tensors) TensorRT-LLM loads as they are, per release and backend, into
pipeline/upstream/trtllm_prequantized.json.

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast` (never runs) the functions it names, from whole
files or from slices of them:
- PyTorch backend: tensorrt_llm/_torch/model_config.py `load_hf_quant_config` (the quant_method values that get a
  QuantAlgo: any other one leaves the model unquantized) and tensorrt_llm/models/quant_config_utils.py
  `_quant_config_from_config_group` (the compressed-tensors schemes: QuantAlgo per weights num_bits / type /
  strategy, and whether the scheme must quantize activations too);
- engine workflow (convert_checkpoint.py, trtllm-build): examples/models/core/llama/convert_checkpoint.py
  `update_quant_config_from_hf` (per quant_method: the QuantAlgo, the quantization_config keys read with their
  defaults and the QuantConfig field each sets, the keys that raise when true, the converter options added) and
  `precision_to_config` (--weight_only_precision -> QuantAlgo); tensorrt_llm/models/llama/convert.py
  `load_weights_from_gptq` (the tensors read per linear, the module names, the zero-point offset, whether g_idx is
  read); convert_checkpoint.py's `parse_arguments` (each flag's type, default, choices, action) and
  `convert_and_save_hf` (whether the checkpoint's own config.json overrides the quantization its flags give).

`verdicts` joins them: per backend and checkpoint method, whether it loads, what it then requires of the checkpoint
and the tensors it reads, or what it lacks. No copy read is at a release's own commit (`pinned` false): each is the
newest copy the index named by commit, read as an upper bound (see NOTE).
"""

from __future__ import annotations

import ast
import re
import textwrap

from tabulate_trtllm_backend import RELEASES as ENGINE_RELEASES
from upstream_source import REPO, UnrecognizedSource, Upstream, cite, dotted_name, stored_releases
from upstream_source import value as literal

MODEL_CONFIG = "tensorrt_llm/_torch/model_config.py"
QUANT_CONFIG_UTILS = "tensorrt_llm/models/quant_config_utils.py"
CONVERT_CHECKPOINT = "examples/models/core/llama/convert_checkpoint.py"
LLAMA_CONVERT = "tensorrt_llm/models/llama/convert.py"
COMMITS = {
    MODEL_CONFIG: "008e0af8980fc560003631ba4ac37828836a91c8",
    QUANT_CONFIG_UTILS: "21156a7a57acd21e17feb5c2721c30f035e0f2af",
    CONVERT_CHECKPOINT: "368f8f2ade001e8fcb955be39e4812f918d7fb92",
    LLAMA_CONVERT: "0afa06ab2971a19a9809c66adc444c9280b16088",
}
PYTORCH_RELEASES = ("1.0", "1.1", "1.2")
# The converter flags the pipeline's command for a kept checkpoint passes (pipeline/targets/trtllm/prequantized.py
# converter_command): where convert_and_save_hf lets config.json's quantization_config decide, no quantization flag
# is needed, and --weight_only_precision int4_awq would wrongly add pre_quant_scale.
COMMAND_FLAGS = ("model_dir", "output_dir", "dtype", "tp_size", "pp_size", "workers")
METHODS = ("gptq", "awq", "compressed-tensors")
NOTE = (
    "No file was readable at a release's own commit. PyTorch backend: the copies read are from 2026, after 1.2; "
    "load_hf_quant_config there maps no gptq or awq quant_method, and its compressed-tensors schemes are FP8, NVFP4 "
    "and MXFP4 only; three older copies of model_config.py seen (commits not known, attributed by content to 1.0, "
    "1.1, 1.2) map fewer quant_methods (fp8 block scales, mxfp4; the third adds compressed-tensors FP8 only), and "
    "the 1.0-era LLM-API loader (llmapi/llm_utils.py, commit not known) raises NotImplementedError for any other "
    "config.json quant_method. So no release 1.0-1.2 loads these checkpoints (a later test copy exercises a gptq "
    "branch: re-tabulate before targeting a release after 1.2). Engine workflow: convert_checkpoint.py read from a "
    "copy with the 2026 deprecation notice, convert.py from an earlier one; both paths (the unified "
    "ModelWeightsLoader, whose W4A16_GPTQ linears name the same three tensors in quantization/layers.py, and "
    "load_weights_from_gptq behind --quant_ckpt_path) are taken to hold for every engine release 0.18-1.2 (0.18 "
    "keeps the script under examples/llama/). Medium confidence for the older releases. The converter's flags (a "
    "kept checkpoint's command line) are read from the same copy of convert_checkpoint.py, whose convert_and_save_hf "
    "lets the checkpoint's quantization_config override the flags' quantization; not re-read per release."
)


# ---------------------------------------------------------------- reading functions out of files or slices


def function_def(source: str, name: str) -> ast.FunctionDef:
    """The first `def name` in `source` (a whole file or a slice, at any indentation), parsed on its own."""
    lines = source.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*def {name}\(", line)), None)
    if start is None:
        raise UnrecognizedSource(f"no def {name}")
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent or lines[end].lstrip()[0] == ")"
    ):
        end += 1
    tree = ast.parse(textwrap.dedent("".join(lines[start:end])))
    return tree.body[0]


def _quant_method_test(test: ast.expr) -> str | None:
    """X of a test `<...>.get('quant_method') == 'X'` (possibly inside an `and`)."""
    for node in ast.walk(test):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Call)
            and isinstance(node.left.func, ast.Attribute)
            and node.left.func.attr == "get"
            and node.left.args
            and isinstance(node.left.args[0], ast.Constant)
            and node.left.args[0].value == "quant_method"
            and isinstance(node.comparators[0], ast.Constant)
        ):
            return node.comparators[0].value
    return None


def _branches(function: ast.FunctionDef) -> list[tuple[str, list[ast.stmt]]]:
    """(quant_method, body) of each branch of the if/elif chains that test quant_method."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.If) and (method := _quant_method_test(node.test)) is not None:
            found.append((method, node.body))
    return found


# ---------------------------------------------------------------- PyTorch backend


def pytorch_quant_methods(source: str) -> list[str]:
    """The quant_method values load_hf_quant_config maps (each to a QuantAlgo or a helper that sets one)."""
    methods = [method for method, _ in _branches(function_def(source, "load_hf_quant_config"))]
    if not methods:
        raise UnrecognizedSource("load_hf_quant_config no longer tests quant_method")
    return methods


def _constant_tests(test: ast.expr) -> dict:
    """{key: value} of the `<weights>["key"] == value` / `<weights>.get("key") == value` comparisons in a test."""
    out = {}
    for node in ast.walk(test):
        if not (isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq)):
            continue
        left, right = node.left, node.comparators[0]
        if not isinstance(right, ast.Constant):
            continue
        if isinstance(left, ast.Subscript) and isinstance(left.slice, ast.Constant):
            out[left.slice.value] = right.value
        elif isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "get":
            out[left.args[0].value] = right.value
        elif isinstance(left, ast.Name) and left.id.endswith("_strategy"):
            out["input_strategy" if left.id.startswith("inputs") else "strategy"] = right.value
    return out


def compressed_tensors_schemes(source: str) -> list[dict]:
    """Each scheme `_quant_config_from_config_group` returns a QuantAlgo for: the weights' num_bits / type /
    strategy it tests, and whether it reads the input activations' strategy first (a weight-only scheme has none)."""
    function = function_def(source, "_quant_config_from_config_group")
    reads_inputs_at = next(
        (
            node.lineno
            for node in ast.walk(function)
            if isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value == "input_activations"
        ),
        None,
    )
    schemes = []

    def visit(statements: list[ast.stmt], tests: dict) -> None:
        for statement in statements:
            if isinstance(statement, ast.If):
                visit(statement.body, tests | _constant_tests(statement.test))
                visit(statement.orelse, tests)
            elif isinstance(statement, ast.Return) and isinstance(statement.value, ast.Call):
                algo = next((k.value for k in statement.value.keywords if k.arg == "quant_algo"), None)
                if isinstance(algo, ast.Attribute):
                    needs = reads_inputs_at is not None and statement.lineno > reads_inputs_at
                    wanted = {k: tests[k] for k in ("num_bits", "type", "strategy", "input_strategy") if k in tests}
                    schemes.append({"quant_algo": algo.attr, **wanted, "needs_input_activations": needs})

    visit(function.body, {})
    if not schemes:
        raise UnrecognizedSource("_quant_config_from_config_group returns no QuantConfig(quant_algo=...)")
    return schemes


# ---------------------------------------------------------------- engine workflow


def engine_quant_methods(source: str) -> dict[str, dict]:
    """update_quant_config_from_hf: per quant_method, the QuantAlgo it sets, the keys read (with default) into
    QuantConfig fields, the keys whose true value raises, and the converter options it adds."""
    methods = {}
    for method, body in _branches(function_def(source, "update_quant_config_from_hf")):
        entry = {"quant_algo": None, "reads": {}, "raises_when_true": [], "converter_options": {}}
        local_keys = {}
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                read = _get_call(value)
                if isinstance(target, ast.Attribute) and target.attr == "quant_algo":
                    entry["quant_algo"] = value.attr if isinstance(value, ast.Attribute) else None
                elif isinstance(target, ast.Attribute) and read:
                    entry["reads"][read[0]] = {"default": read[1], "sets": target.attr}
                elif isinstance(target, ast.Name) and read:
                    local_keys[target.id] = read[0]
            elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id in local_keys:
                if any(isinstance(s, ast.Raise) for s in node.body):
                    entry["raises_when_true"].append(local_keys[node.test.id])
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".update") and node.args:
                if isinstance(node.args[0], ast.Dict):
                    entry["converter_options"] |= ast.literal_eval(node.args[0])
        methods[method] = entry
    if not methods:
        raise UnrecognizedSource("update_quant_config_from_hf no longer tests quant_method")
    return methods


def _get_call(node: ast.expr) -> tuple[str, object] | None:
    """(key, default) of `<...>.get('key', default)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        if isinstance(node.args[0], ast.Constant):
            default = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
            return node.args[0].value, default
    return None


def weight_only_precisions(source: str) -> dict[str, str]:
    """precision_to_config's --weight_only_precision -> QuantAlgo."""
    for node in ast.walk(function_def(source, "precision_to_config")):
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: v.attr for k, v in zip(node.keys, node.values) if isinstance(v, ast.Attribute)}
    raise UnrecognizedSource("precision_to_config has no precision -> QuantAlgo dict")


def _flatten(node: ast.expr) -> list[ast.expr]:
    """The operands of a chain of `+`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _flatten(node.left) + _flatten(node.right)
    return [node]


def gptq_loader(source: str) -> dict:
    """load_weights_from_gptq: the name prefix of a layer, the linear modules and the tensor suffixes it reads for
    each, the zero-point offset it subtracts (1: GPTQ v1's stored-minus-one zeros), and whether it reads g_idx."""
    function = function_def(source, "load_weights_from_gptq")
    names = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    suffixes, keys = names.get("gptq_suffix_list"), names.get("gptq_key_list")
    if not isinstance(suffixes, list) or not isinstance(keys, list):
        raise UnrecognizedSource("load_weights_from_gptq lacks gptq_suffix_list or gptq_key_list")
    loops = {
        node.target.id: ast.literal_eval(node.iter)
        for node in ast.walk(function)
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.List)
    }
    layer_prefix = None
    modules = []
    in_source_order = sorted(
        (n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.Call))), key=lambda n: (n.lineno, n.col_offset)
    )
    for node in in_source_order:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "prefix":
            parts = []
            for part in _flatten(node.value):
                if isinstance(part, ast.Constant):
                    parts.append(part.value)
                elif isinstance(part, ast.Name) and isinstance(names.get(part.id), str):
                    parts.append(names[part.id])
                else:
                    parts.append("{layer}")
            layer_prefix = names.get("gptq_prefix", "") + "".join(parts)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "load" and node.args:
            parts = _flatten(node.args[0])
            if not any(isinstance(p, ast.Name) and p.id == "suf" for p in parts):
                continue
            variants = [""]
            for part in parts:
                if isinstance(part, ast.Subscript) and ast.unparse(part.value) == "gptq_key_list":
                    variants = [v + keys[ast.literal_eval(part.slice)] for v in variants]
                elif isinstance(part, ast.Name) and part.id in loops:
                    variants = [v + item for v in variants for item in loops[part.id]]
            modules += [v for v in variants if v not in modules]
    if layer_prefix is None or not modules:
        raise UnrecognizedSource("load_weights_from_gptq: no layer prefix or no linear loads")
    return {
        "layer_prefix": layer_prefix,
        "modules": modules,
        "tensor_suffixes": [s.lstrip(".") for s in suffixes],
        "zero_point_offset": names.get("USE_GPTQ_FOR_LLAMA"),
        "reads_g_idx": "g_idx" in ast.unparse(function),
    }


# ---------------------------------------------------------------- the converter's command line


def converter_arguments(source: str) -> dict[str, dict]:
    """parse_arguments: each `--flag` (without dashes) with its type, default, choices, action, nargs, const and
    short aliases, as far as the call gives them."""
    out = {}
    for node in ast.walk(function_def(source, "parse_arguments")):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".add_argument")):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        long = next((n for n in names if n.startswith("--")), None)
        if long is None:
            continue
        entry = {}
        for keyword in node.keywords:
            if keyword.arg == "help":
                continue
            if keyword.arg == "type":
                entry["type"] = ast.unparse(keyword.value)
            elif isinstance(found := literal(keyword.value), dict):  # not a literal: the name it refers to, if any
                entry[keyword.arg] = {"named": dotted_name(keyword.value)}
            else:
                entry[keyword.arg] = found
        aliases = [n for n in names if n != long]
        out[long[2:]] = dict(sorted(entry.items())) | ({"aliases": aliases} if aliases else {})
    if not out:
        raise UnrecognizedSource("parse_arguments adds no --flag")
    return out


def quantization_from_checkpoint(source: str) -> bool:
    """Whether convert_and_save_hf passes the quantization its flags give (args_to_quant_config) through
    update_quant_config_from_hf, which sets it from the checkpoint's config.json quantization_config."""
    function = function_def(source, "convert_and_save_hf")
    from_flags_at, from_config_at = None, None
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called, target = ast.unparse(node.value.func), node.targets[0]
            targets = [ast.unparse(t) for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            if called == "args_to_quant_config" and targets == ["quant_config"]:
                from_flags_at = node.lineno
            elif called == "update_quant_config_from_hf" and "quant_config" in targets:
                if node.value.args and ast.unparse(node.value.args[0]) == "quant_config":
                    from_config_at = node.lineno
    if from_flags_at is None:
        raise UnrecognizedSource("convert_and_save_hf no longer takes its quantization from args_to_quant_config")
    return from_config_at is not None and from_config_at > from_flags_at


def converter(arguments: dict[str, dict], from_checkpoint: bool, source: dict) -> dict:
    """What a kept checkpoint's command needs of the converter: its script, the COMMAND_FLAGS as it defines them."""
    missing = [flag for flag in COMMAND_FLAGS if flag not in arguments]
    if missing:
        raise UnrecognizedSource(f"parse_arguments lacks --{', --'.join(missing)}")
    if not from_checkpoint:
        raise UnrecognizedSource("convert_and_save_hf no longer reads the checkpoint's quantization_config")
    return {
        "script": source["path"],
        "arguments": {flag: arguments[flag] for flag in COMMAND_FLAGS},
        "quantization_from_checkpoint_config": from_checkpoint,
        "source": source,
    }


# ---------------------------------------------------------------- verdicts


def pytorch_verdicts(methods: list[str], schemes: list[dict], sources: dict) -> dict[str, dict]:
    out = {}
    for method in METHODS:
        if method not in methods:
            out[method] = {
                "loads": False,
                "lacks": f"load_hf_quant_config maps no quant_method {method!r} (mapped: {', '.join(methods)})",
                "source": sources[MODEL_CONFIG],
            }
            continue
        integer = [s for s in schemes if s.get("type") != "float" and not s["needs_input_activations"]]
        out[method] = {
            "loads": bool(integer),
            "lacks": None
            if integer
            else "_quant_config_from_config_group maps no integer weight-only scheme (W4A16/W8A16 pack-quantized); "
            f"its schemes: {', '.join(s['quant_algo'] for s in schemes)}",
            "source": sources[QUANT_CONFIG_UTILS],
        }
    return out


def engine_verdicts(methods: dict[str, dict], loader: dict, sources: dict, command: dict | None = None) -> dict:
    out = {}
    for method in METHODS:
        entry = methods.get(method)
        if entry is None or entry["quant_algo"] is None:
            out[method] = {
                "loads": False,
                "lacks": f"update_quant_config_from_hf maps no quant_method {method!r} (mapped: {', '.join(methods)})",
                "source": sources[CONVERT_CHECKPOINT],
            }
            continue
        bits = int(re.match(r"W(\d+)A", entry["quant_algo"]).group(1))
        requires = {"bits": bits} | {key: False for key in entry["raises_when_true"]}
        if method == "gptq":
            requires["packing"] = "gptq_v1" if loader["zero_point_offset"] == 1 else "gptq_v2"
        if entry["converter_options"].get("use_autoawq"):
            requires["packing"] = "awq_gemm"
        out[method] = {
            "loads": True,
            "quant_algo": entry["quant_algo"],
            "converter_options": entry["converter_options"],
            "requires": requires,
            "config_keys": entry["reads"],
            "layer_prefix": loader["layer_prefix"],
            "modules": loader["modules"],
            "tensors": loader["tensor_suffixes"],
            "reads_g_idx": loader["reads_g_idx"],
            **({"converter": command} if command else {}),
            "source": [sources[CONVERT_CHECKPOINT], sources[LLAMA_CONVERT]],
        }
    return out


def tabulate(upstream: Upstream) -> dict:
    text = {path: upstream.read(REPO, path, commit) for path, commit in COMMITS.items()}
    sources = {path: cite(REPO, path, commit, pinned=False) for path, commit in COMMITS.items()}
    torch_methods = pytorch_quant_methods(text[MODEL_CONFIG])
    schemes = compressed_tensors_schemes(text[QUANT_CONFIG_UTILS])
    engine_methods = engine_quant_methods(text[CONVERT_CHECKPOINT])
    loader = gptq_loader(text[LLAMA_CONVERT])
    arguments = converter_arguments(text[CONVERT_CHECKPOINT])
    command = converter(arguments, quantization_from_checkpoint(text[CONVERT_CHECKPOINT]), sources[CONVERT_CHECKPOINT])
    verdicts = {
        "pytorch": pytorch_verdicts(torch_methods, schemes, sources),
        "tensorrt": engine_verdicts(engine_methods, loader, sources, command),
    }
    releases = {}
    for release in sorted(set(ENGINE_RELEASES) | set(PYTORCH_RELEASES), key=lambda v: tuple(map(int, v.split(".")))):
        releases[release] = {
            backend: verdicts[backend] if release in members else None
            for backend, members in (("pytorch", PYTORCH_RELEASES), ("tensorrt", ENGINE_RELEASES))
        }
    return {
        "note": NOTE,
        "pytorch": {
            "quant_methods": torch_methods,
            "compressed_tensors_schemes": schemes,
            "source": [sources[MODEL_CONFIG], sources[QUANT_CONFIG_UTILS]],
        },
        "tensorrt": {
            "quant_methods": engine_methods,
            "weight_only_precisions": weight_only_precisions(text[CONVERT_CHECKPOINT]),
            "gptq_loader": loader,
            "converter_arguments": arguments,
            "source": [sources[CONVERT_CHECKPOINT], sources[LLAMA_CONVERT]],
        },
        "releases": stored_releases(releases),
    }
