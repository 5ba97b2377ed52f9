"""Tabulate, per TensorRT-LLM release 1.0-1.2, what the PyTorch backend does with two pairs of features a build config
can combine, and which xgrammar each release (0.19-1.2) depends on with what that xgrammar reads of a tokenizer
(pipeline/upstream/trtllm_pytorch_features.json, issue #48).

Maintainer tool, run by scripts/dev/tabulate_all.py. Per release:

- `guided_with_speculative`: tensorrt_llm/_torch/pyexecutor/py_executor_creator.py, the block that creates the guided
  decoder when the executor has a guided decoding config, run (never the file: its statements, with `ast`) for every
  SpeculativeDecodingMode of the release's tensorrt_llm/_torch/speculative/interface.py, whose predicates
  (`support_guided_decoder`, `has_spec_drafter`, ...) are evaluated from the enum class itself. A mode is `allowed`
  when the block gets through without raising; the exception it raises otherwise is named.
- `lora_with_cuda_graph`: tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py, the method that replays a captured
  graph (`replay`, or `run` of the older DecodingCUDAGraphRunner): which request inputs it copies into the graph's
  static buffers (a captured graph sees nothing else new) and which it only checks to be the captured objects. No
  LoRA input among them: a graph captured without LoRA parameters replays for LoRA requests too. A release whose
  model engine feeds LoRA to graphs another way (TensorRT-LLM PR #8279's CUDA-graph LoRA manager) must be read in
  model_engine.py before it is tabulated; `supported` here only says what the replay refreshes.
- `xgrammar`: the version the release notes (1.2.0's, as TensorRT-LLM's documentation site published them) say each
  release updated to, carried forward to a release that names none, and the requirement's form in the release's
  requirements.txt copy.

Per C++-backend release 0.19-0.21 (`cpp_backend_xgrammar`; no PyTorch-backend facts): the xgrammar its Triton
`tensorrtllm` backend hands the tokenizer to. The C++ guided decoder compiles xgrammar from the 3rdparty/xgrammar
submodule, whose commit no copy read here gives, so the version is the pin of a requirements.txt copy of the
release's line: a copy whose TensorRT and ModelOpt pins are those the release notes give that release (carried
forward), else refused. A release with no such copy is bounded by the release before it and 1.0's noted xgrammar,
and tabulated only when every xgrammar version between reads a tokenizer alike.

Once per xgrammar version (`xgrammar`, tag commits of mlc-ai/xgrammar): what cpp/tokenizer_info.cc's
DetectMetadataFromHF reads of a Hugging Face tokenizer JSON (the vocabulary type from `decoder`, add_prefix_space from
`normalizer` / `pre_tokenizer`), the VocabType values, and the metadata keys FromVocabAndMetadata requires. Once
(`tokenizer_info_consumer`): how TensorRT-LLM's C++ guided decoder (cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp,
which loads the xgrammar tokenizer info file of the Triton tensorrt_llm model) hands a tokenizer to xgrammar.

The sources directory may hold a whole file or a contiguous slice of it holding the block read (the copies the
index serves in pages); every block is found by its header and indentation, so both read alike. No TensorRT-LLM copy
is at a release's own commit (`pinned` false, `release_commit` names it); some are forks' copies (the repository says
so), read where no NVIDIA copy of that release line could be.
"""

from __future__ import annotations
import __future__

import ast
import json
import re
import textwrap
from enum import IntEnum, auto
from types import SimpleNamespace

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, stored_releases

CREATOR = "tensorrt_llm/_torch/pyexecutor/py_executor_creator.py"
INTERFACE = "tensorrt_llm/_torch/speculative/interface.py"
RUNNER = "tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py"
REQUIREMENTS = "requirements.txt"
NOTES = "1.2.0/_sources/release-notes.md.txt"  # TensorRT-LLM's gh-pages branch, as 1.2.0's documentation
NOTES_COMMIT = "7e873e54c296912df55b4c961e67079963ae4d34"
GUIDED_DECODER_CPP = "cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp"
GUIDED_DECODER_COMMIT = "2a9abd9536aa62ad3e4b9314be9286b1b1be523b"
XGRAMMAR_REPO = "mlc-ai/xgrammar"
XGRAMMAR_CC = "cpp/tokenizer_info.cc"
XGRAMMAR_H = "include/xgrammar/tokenizer_info.h"
XGRAMMAR_TAGS = {  # tag v<version> -> its commit
    "0.1.16": "989222175c2a30fb7987d8bcce35bec1bf6817f2",
    "0.1.17": "4d442e64b705941cf0c41c62fb74b9ace90960a9",
    "0.1.18": "8062becde6678f9944f4c0c1f0f88c638dcfb566",
    "0.1.19": "742a3809b2081c7b8e9ca4d2270ab3c511a3470d",
    "0.1.20": "f5181ac818607a7aaff81030aba6e0c511dc988a",
    "0.1.21": "774867ce410ce1c5c7c10011cc0a9e20bd7894e2",
    "0.1.25": "e4e816f5f0fe39f5b1601a17a4552307fa3b70ff",
}
# Per release: (repository, commit) of each copy read.
RELEASES = {
    "1.0": {
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        CREATOR: ("BHbean/TensorRT-LLM", "22d1bd423cb69070be4ae4b1140c0ee71ab98b66"),
        INTERFACE: None,  # its guided block refuses every speculative config before looking at the mode
        RUNNER: ("jinyangyuan-nvidia/TensorRT-LLM", "716215fe07d51c5acab1e2e9cf42460cdcb27758"),
        REQUIREMENTS: (REPO, "10bfbb57a9af872c052e503bbed3494a39b7dae5"),
        "note": "1.0-line copies from forks: py_executor_creator.py of the executor_config era (the fork adds logging "
        "lines, not to the guided block); DecodingCUDAGraphRunner.run (the fork adds overlap buffers run() does not "
        "touch). requirements.txt is a main-line copy from before 1.0 (xgrammar 0.1.19): only the pin's form.",
    },
    "1.1": {
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        CREATOR: (REPO, "bab0f2e6eea19bcce16c805101420ef7d9d62d75"),
        INTERFACE: (REPO, "b35ac1b64368513d215c57d2ed01d62d910df8da"),
        RUNNER: ("QiJune/TensorRT-LLM", "52c8a0c68c5f9f5d7d09b715b05e5ac6d78378e0"),
        REQUIREMENTS: (REPO, "b35ac1b64368513d215c57d2ed01d62d910df8da"),
        "note": "py_executor_creator.py: a main-line copy of the 1.1 line (pytorch_backend_config, "
        "max_total_draft_tokens); interface.py and requirements.txt: main at 1.2.0rc2, just after 1.1 branched; "
        "cuda_graph_runner.py: a fork's copy of the first CUDAGraphRunner (replay keyed by batch size and draft "
        "length).",
    },
    "1.2": {
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        CREATOR: (REPO, "585c756579dc4d01f21fc13c2f604cdb461ac4f0"),
        INTERFACE: (REPO, "585c756579dc4d01f21fc13c2f604cdb461ac4f0"),
        RUNNER: (REPO, "585c756579dc4d01f21fc13c2f604cdb461ac4f0"),
        REQUIREMENTS: (REPO, "000867d9b1ad62f3de1e54e111c094da492a5626"),
        "note": "Main-line copies of the 1.2 line (585c7565 is the commit trtllm_lora reads lora_helper.py of 1.2 "
        "at); requirements.txt from the CUDA 13 / torch 2.9 line.",
    },
}
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
SUBMODULE = "tensorrt_llm"  # its submodule pointing to the NVIDIA/TensorRT-LLM release commit
# Per C++-backend release: its release commit, the tensorrtllm_backend release commit whose submodule names it, and
# the (repository, commit) of the requirements.txt copy of its line read (None: no copy found).
CPP_RELEASES = {
    "0.19": {
        "release_commit": "c6f7d423354214df818e206e87680fb2d513a718",
        "release_commit_from": "c1e19638304d287f554f738c1411746555ed348c",  # tag v0.19.0
        REQUIREMENTS: ("jellysnack/TensorRT-LLM", "4f188e92006dfe09def47b1062997160658d81f7"),
        "note": "A fork's copy of the 0.19 line (no NVIDIA copy of it is readable).",
    },
    "0.20": {
        "release_commit": "7965842954628b0b5456a2f7d59786d3dcd41647",
        "release_commit_from": "40ab7b32e539d410cf29bc3f0463cb17be3fe50b",  # tag v0.20.0
        REQUIREMENTS: ("nv-auto-deploy/TensorRT-LLM", "70340ef0a183e48c2503c3a0a6b1a0d9bdd93148"),
        "note": "A fork's copy of the 0.20 line (no NVIDIA copy of it is readable).",
    },
    "0.21": {
        "release_commit": "b4b1185af320f109f4cb73b1505832dbc63042d7",
        "release_commit_from": "2710a1ff62a700dbe01ae67f56d200102c249c46",  # tag v0.21.0
        REQUIREMENTS: None,
        "note": "No copy of the 0.21 line's requirements.txt was found: its xgrammar is taken to lie between 0.20's "
        "and 1.0's (the pin rising along main, from which each release branches), every version of which reads a "
        "tokenizer alike.",
    },
}
CPP_NOTE = (
    "The C++ guided decoder compiles xgrammar from the 3rdparty/xgrammar submodule, whose commit no copy read here "
    "gives: the version is the pin of a requirements.txt copy of the release's line (its TensorRT and ModelOpt pins "
    "those the release notes give the release), or bounded by the releases around it."
)
NOTES_HEADING = re.compile(r"^## TensorRT-LLM Release (\d+\.\d+)(?:\.\d+)?[ \t]*$", re.M)
XGRAMMAR_NOTE = re.compile(r"\bxgrammar version is updated to (\d+\.\d+\.\d+)\b")
GUIDED_SPECULATIVE_NOTE = re.compile(r"guided decoding[^\n]*\bspeculative decoding", re.I)
XGRAMMAR_PIN = re.compile(r"^xgrammar\s*(==|~=|>=)\s*(\d+\.\d+\.\d+)\s*$", re.M)
# What places a requirements.txt copy on a release's line: (the notes' update line, the copy's pin), by dependency.
RELEASE_LINE = {
    "tensorrt": (
        re.compile(r"\bdependent TensorRT version is updated to (\d+\.\d+)"),
        re.compile(r"^tensorrt\s*~=\s*(\d+\.\d+)", re.M),
    ),
    "modelopt": (
        re.compile(r"\bdependent NVIDIA ModelOpt version is updated to (\d+\.\d+)"),
        re.compile(r"^nvidia-modelopt(?:\[\w+\])?\s*~=\s*(\d+\.\d+)", re.M),
    ),
}


# ---------------------------------------------------------------- blocks out of files or slices


def block(text: str, header: str) -> str:
    """The statement whose first line matches `header` (a regex), with every following line indented deeper (or
    blank), dedented: found alike in a whole file and in a slice of one."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(header, line)), None)
    if start is None:
        raise UnrecognizedSource(f"no line matches {header!r}")
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])) + "\n"


# ---------------------------------------------------------------- guided decoding with speculative decoding


def speculative_modes(interface: str) -> type[IntEnum]:
    """The release's SpeculativeDecodingMode, built from its own class statement (annotations left unevaluated)."""
    source = block(interface, r"class SpeculativeDecodingMode\(IntEnum\):")
    namespace = {"IntEnum": IntEnum, "auto": auto}
    flags = __future__.annotations.compiler_flag
    exec(compile(source, INTERFACE, "exec", flags=flags, dont_inherit=True), namespace)  # noqa: S102
    return namespace["SpeculativeDecodingMode"]


class _Unknown:
    """A value the block's test must not need (1.0's block is read without the release's modes)."""

    def __bool__(self):
        raise UnrecognizedSource("the guided block tests the speculative mode: read the release's interface.py")

    def __getattr__(self, name):
        raise UnrecognizedSource(f"the guided block reads spec_dec_mode.{name}: read the release's interface.py")


def _names(mode) -> dict:
    """What the guided block's tests read, for one speculative mode (None: no speculative config)."""
    known = mode is not None and not isinstance(mode, _Unknown)
    spec = None if mode is None else SimpleNamespace(spec_dec_mode=mode, max_draft_len=1, max_total_draft_tokens=1)
    config = object()
    return {
        "spec_config": spec,
        "guided_decoding_config": config,
        "executor_config": SimpleNamespace(guided_decoding_config=config, max_batch_size=1),
        "mapping": SimpleNamespace(is_last_pp_rank=lambda: True, rank=0),
        "has_spec_drafter": mode.has_spec_drafter() if known else (False if mode is None else _Unknown()),
        "has_draft_model_engine": mode.has_draft_model() if known else (False if mode is None else _Unknown()),
    }


def _raises(statements: list[ast.stmt], names: dict) -> str | None:
    """The exception the statements raise on this path (its class name), or None when they get through. Tests are
    evaluated; an assignment to a name records a created object (a call that succeeds); nothing else runs."""
    for node in statements:
        if isinstance(node, ast.Raise):
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            return call.id if isinstance(call, ast.Name) else ast.unparse(call)
        if isinstance(node, ast.If):
            try:
                taken = eval(compile(ast.Expression(node.test), CREATOR, "eval"), {"__builtins__": {}}, names)  # noqa: S307
            except NameError as error:
                raise UnrecognizedSource(f"the guided block tests a name not modelled here: {error}") from error
            raised = _raises(node.body if taken else node.orelse, names)
        elif isinstance(node, ast.With):
            raised = _raises(node.body, names)
        else:
            raised = None
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        names[target.id] = node.value is not None and not (
                            isinstance(node.value, ast.Constant) and node.value.value is None
                        )
        if raised:
            return raised
    return None


def guided_block(creator: str) -> list[ast.stmt]:
    """The `if ...guided_decoding_config is not None:` statement that creates the guided decoder."""
    return ast.parse(block(creator, r"\s*if (\w+\.)?guided_decoding_config is not None:")).body


def guided_with_speculative(creator: str, interface: str | None) -> dict:
    """Which speculative modes the release creates a guided decoder with, and what it raises for the others."""
    statements = guided_block(creator)
    if _raises(statements, _names(None)):
        raise UnrecognizedSource("the guided block raises without speculative decoding")
    if interface is None:
        raised = _raises(statements, _names(_Unknown()))
        if not raised:
            raise UnrecognizedSource("the guided block allows an unknown mode: read the release's interface.py")
        return {"allowed_modes": [], "refused_modes": "every", "raises": raised}
    modes = [m for m in speculative_modes(interface) if m.name not in ("NONE", "AUTO")]
    outcome = {m.name: _raises(statements, _names(m)) for m in modes}
    refused = [name for name, raised in outcome.items() if raised]
    raises = sorted({raised for raised in outcome.values() if raised})
    return {
        "allowed_modes": [name for name, raised in outcome.items() if not raised],
        "refused_modes": refused,
        "raises": raises[0] if len(raises) == 1 else raises or None,
    }


# ---------------------------------------------------------------- LoRA under CUDA graphs


def graph_replay(runner: str) -> dict:
    """What the runner's replay copies into a captured graph's inputs, and what it only checks to be the captured
    objects (an `assert <input> is <captured>`)."""
    source = block(runner, r"\s*def (replay|run)\(")
    function = ast.parse(source).body[0]
    inputs = function.args.args[-1].arg  # (self, [key or batch size,] inputs)

    def key_of(node) -> str | None:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == inputs:
            return node.slice.value if isinstance(node.slice, ast.Constant) else None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == inputs
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return node.args[0].value
        return None

    aliases = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            key = key_of(node.value)
            if key:
                aliases[node.targets[0].id] = key
    read = list(dict.fromkeys(k for k in (key_of(n) for n in ast.walk(function)) if k))
    checked = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and isinstance(node.test.ops[0], ast.Is):
            left = node.test.left
            key = key_of(left) or (aliases.get(left.id) if isinstance(left, ast.Name) else None)
            if key:
                checked.append(key)
    if not read:
        raise UnrecognizedSource(f"{function.name} reads no input of {inputs}")
    refreshed = [key for key in read if key not in checked]
    lora = [key for key in read if "lora" in key.lower()] or (["(named in the method)"] if "lora" in source else [])
    return {
        "replay_method": function.name,
        "inputs_refreshed": refreshed,
        "inputs_checked_same": checked,
        "lora_inputs": lora,
        "supported": bool(lora),
    }


# ---------------------------------------------------------------- xgrammar


def notes_sections(notes: str) -> dict[str, str]:
    """Release notes: {X.Y: its section's text}, newest first as the notes list them."""
    heads = list(NOTES_HEADING.finditer(notes))
    return {
        m.group(1): notes[m.end() : (heads[i + 1].start() if i + 1 < len(heads) else len(notes))]
        for i, m in enumerate(heads)
    }


def _order(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split(".")))


def noted(notes: str, pattern: re.Pattern) -> dict[str, str | None]:
    """Per release of the notes, the last version `pattern` finds in its section or an older one's (None: none)."""
    sections = notes_sections(notes)
    versions, current = {}, None
    for release in sorted(sections, key=_order):
        named = pattern.findall(sections[release])
        current = named[-1] if named else current
        versions[release] = current
    return versions


def xgrammar_versions(notes: str, releases) -> dict[str, str]:
    """The xgrammar each release depends on: the last version the notes say a release up to it updated to."""
    versions = noted(notes, XGRAMMAR_NOTE)
    missing = [r for r in releases if not versions.get(r)]
    if missing:
        raise UnrecognizedSource(f"the notes name no xgrammar version up to {missing}")
    return {r: versions[r] for r in releases}


def first_noted(notes: str, pattern: re.Pattern) -> str | None:
    """The oldest release whose notes section has a line matching `pattern`."""
    sections = notes_sections(notes)
    hits = [r for r in sections if pattern.search(sections[r])]
    return min(hits, key=_order) if hits else None


def requirement_pin(requirements: str) -> dict:
    found = XGRAMMAR_PIN.findall(requirements)
    if len(found) != 1:
        raise UnrecognizedSource(f"requirements.txt pins xgrammar {len(found)} times")
    return {"operator": found[0][0], "version": found[0][1]}


def release_line(requirements: str, notes: str, release: str) -> dict:
    """The TensorRT and ModelOpt versions (major.minor) a requirements.txt copy pins, which must be those the notes
    give `release` (carried forward): the copy is of that release's line, else it is refused."""
    line = {}
    for name, (update, pin) in RELEASE_LINE.items():
        pinned, given = pin.findall(requirements), noted(notes, update).get(release)
        if pinned != [given]:
            raise UnrecognizedSource(f"requirements.txt pins {name} {pinned}, the notes give {release} {given}")
        line[name] = given
    return line


def xgrammar_between(low: str, high: str, tags) -> list[str]:
    """The tabulated xgrammar versions from `low` to `high`, both named and both included, in order."""
    if low not in tags or high not in tags or _order(low) > _order(high):
        raise UnrecognizedSource(f"xgrammar {low} to {high}: tabulate both tags, the lower first")
    return sorted((v for v in tags if _order(low) <= _order(v) <= _order(high)), key=_order)


def _cpp_body(text: str, signature: str) -> str:
    """The braces-delimited body of the C++ function whose signature matches `signature`."""
    match = re.search(signature, text)
    if not match:
        raise UnrecognizedSource(f"no C++ function matches {signature!r}")
    start = text.index("{", match.end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    raise UnrecognizedSource(f"{signature!r}: unbalanced braces")


def _one(pattern: str, text: str, what: str, flags: int = 0):
    match = re.search(pattern, text, flags)
    if not match:
        raise UnrecognizedSource(f"{what}: {pattern!r} not found")
    return match.groups() if len(match.groups()) > 1 else match.group(1)


def xgrammar_reads(cc: str, header: str) -> dict:
    """What xgrammar reads of a Hugging Face tokenizer JSON (DetectMetadataFromHF) and of its metadata."""
    enum = _one(r"enum class VocabType[^{]*\{(.*?)\};", header, "VocabType", re.S)
    vocab_types = {name: int(number) for name, number in re.findall(r"(\w+)\s*=\s*(\d+)", enum)}
    vocab = _cpp_body(cc, r"static VocabType DetectVocabType\(")
    field = _one(r'hf_tokenizer_obj\.count\("(\w+)"\)', vocab, "decoder field")
    sequence, items = _one(
        r'if \(type == "(\w+)"\) \{\s*CHECK_AND_WARNING\(\s*\w+\.count\("(\w+)"\)', vocab, "Sequence"
    )
    by_type = dict(re.findall(r'type == "(\w+)"\) \{\s*return VocabType::(\w+);', vocab))
    otherwise = re.findall(r"return VocabType::(\w+);", vocab)[-1]
    prefix = _cpp_body(cc, r"static bool DetectAddPrefixSpace\(")
    rules = []
    for detector in re.findall(r"(\w+)\(hf_tokenizer_obj\)", prefix):
        body = _cpp_body(cc, rf"static bool {detector}\(")
        rule = {"field": _one(r'hf_tokenizer_obj\.count\("(\w+)"\)', body, detector)}
        listed = re.search(r'if \(type == "(\w+)"\) \{\s*if \(!\w+\.count\("(\w+)"\)', body)
        if listed:
            rule["sequence"] = {"type": listed.group(1), "items": listed.group(2)}
        prepend = re.search(r'type == "(\w+)" && \w+\.count\("(\w+)"\).*?== "([^"]+)"\) \{\s*return true;', body, re.S)
        scheme = re.search(r'auto (\w+) = \w+\.at\("(\w+)"\)[^;]*;\s*return type == "(\w+)" && \(([^;]*)\);', body)
        if prepend:
            rule |= {"type": prepend.group(1), "key": prepend.group(2), "values": [prepend.group(3)]}
        elif scheme:
            values = re.findall(rf'{scheme.group(1)} == "(\w+)"', scheme.group(4))
            rule |= {"type": scheme.group(3), "key": scheme.group(2), "values": values}
        else:
            raise UnrecognizedSource(f"{detector}: no type/key/value test recognized")
        rules.append(rule)
    detected = _cpp_body(cc, r"std::string TokenizerInfo::Impl::DetectMetadataFromHF\(")
    metadata = _cpp_body(cc, r"TokenizerInfo::Impl::FromVocabAndMetadata\(")
    for name, table in (("vocab_type", by_type), ("otherwise", {otherwise: otherwise})):
        unknown = set(table.values()) - set(vocab_types)
        if unknown:
            raise UnrecognizedSource(f"{name}: {unknown} is no VocabType")
    return {
        "vocab_types": vocab_types,
        "detect_from_hf": {
            "vocab_type": {
                "field": field,
                "sequence": {"type": sequence, "items": items},
                "by_type": by_type,
                "otherwise": otherwise,
            },
            "add_prefix_space": rules,
            "returns": re.findall(r'metadata_obj\["(\w+)"\]', detected),
        },
        "metadata_requires": list(dict.fromkeys(re.findall(r'obj\.count\("(\w+)"\)', metadata))),
    }


def tokenizer_info_consumer(cpp: str) -> dict:
    """How TensorRT-LLM's C++ guided decoder builds xgrammar's TokenizerInfo from the guided decoding config."""
    calls = re.findall(r"xgrammar::TokenizerInfo::(\w+)\(", cpp)
    if "xgrammar::TokenizerInfo(" not in cpp or not calls:
        raise UnrecognizedSource("guidedDecoder.cpp builds no xgrammar::TokenizerInfo the way read here")
    return {
        "xgrammar_calls": calls,
        "metadata_read": re.findall(r'\.at\("(\w+)"\)', cpp),
        "config_read": list(dict.fromkeys(re.findall(r"guidedDecodingConfig\.get(\w+)\(", cpp))),
        "vocab_size": "the model's padded vocabulary size" if "mVocabSizePadded" in cpp else None,
    }


# ---------------------------------------------------------------- the table


def _cite(release: str, path: str) -> dict:
    repo, commit = RELEASES[release][path]
    return cite(repo, path, commit, pinned=False) | {"release_commit": RELEASES[release]["release_commit"]}


def release_entry(upstream: Upstream, release: str, xgrammar: str) -> dict:
    spec = RELEASES[release]
    read = {path: upstream.read(spec[path][0], path, spec[path][1]) for path in (CREATOR, RUNNER, REQUIREMENTS)}
    interface = upstream.read(spec[INTERFACE][0], INTERFACE, spec[INTERFACE][1]) if spec[INTERFACE] else None
    pin = requirement_pin(read[REQUIREMENTS])
    paths = (CREATOR, INTERFACE, RUNNER, REQUIREMENTS)
    return {
        "source": {"files": [_cite(release, path) for path in paths if spec[path]], "note": spec["note"]},
        "guided_with_speculative": guided_with_speculative(read[CREATOR], interface),
        "lora_with_cuda_graph": graph_replay(read[RUNNER]),
        "xgrammar": {
            "version": xgrammar,
            "requirement": f"{pin['operator']}{xgrammar}",
            "requirements_copy_pins": f"{pin['operator']}{pin['version']}",
        },
    }


def cpp_release_entry(upstream: Upstream, notes: str, release: str, bounds: tuple[str, str]) -> dict:
    """A C++-backend release's xgrammar: its requirements.txt copy's pin, the copy checked to be of its line; without
    a copy, every tabulated version within `bounds` (the versions of the releases around it)."""
    spec = CPP_RELEASES[release]
    source = {
        "files": [],
        "release_commit": spec["release_commit"],
        "release_commit_from": cite(BACKEND_REPO, SUBMODULE, spec["release_commit_from"]),
        "note": spec["note"],
    }
    if spec[REQUIREMENTS] is None:
        versions = xgrammar_between(*bounds, XGRAMMAR_TAGS)
        return {"source": source, "release_line": None, "xgrammar": {"version": None, "versions": versions}}
    repo, commit = spec[REQUIREMENTS]
    requirements = upstream.read(repo, REQUIREMENTS, commit)
    pin = requirement_pin(requirements)
    source["files"].append(cite(repo, REQUIREMENTS, commit, pinned=False) | {"release_commit": spec["release_commit"]})
    return {
        "source": source,
        "release_line": release_line(requirements, notes, release),
        "xgrammar": {"version": pin["version"], "requirement": f"{pin['operator']}{pin['version']}"},
    }


def cpp_backend_xgrammar(upstream: Upstream, notes: str, after: str) -> dict:
    """Per C++-backend release, oldest first, its xgrammar; `after` is the version of the first PyTorch release,
    the upper bound of a release with no requirements.txt copy (the lower: the version of the release before)."""
    releases, previous = {}, None
    for release in sorted(CPP_RELEASES, key=_order):
        entry = cpp_release_entry(upstream, notes, release, (previous, after))
        releases[release] = entry
        previous = entry["xgrammar"]["version"] or entry["xgrammar"]["versions"][-1]
    return {"note": CPP_NOTE, "releases": releases}


def xgrammar_facts(upstream: Upstream, version: str, calls: list[str]) -> dict:
    """What xgrammar `version` (its tag's files) reads of a tokenizer; it must define what the C++ decoder calls."""
    commit = XGRAMMAR_TAGS[version]
    cc, header = (upstream.read(XGRAMMAR_REPO, path, commit) for path in (XGRAMMAR_CC, XGRAMMAR_H))
    missing = [call for call in calls if f"TokenizerInfo::{call}(" not in cc]
    if missing:
        raise UnrecognizedSource(f"xgrammar {version} defines no {missing}, which guidedDecoder.cpp calls")
    return {"source": [cite(XGRAMMAR_REPO, path, commit) for path in (XGRAMMAR_CC, XGRAMMAR_H)]} | xgrammar_reads(
        cc, header
    )


def tabulate(upstream: Upstream) -> dict:
    notes = upstream.read(REPO, NOTES, NOTES_COMMIT)
    versions = xgrammar_versions(notes, RELEASES)
    releases = {release: release_entry(upstream, release, versions[release]) for release in RELEASES}
    enabling = first_noted(notes, GUIDED_SPECULATIVE_NOTE)
    allowing = [r for r, e in releases.items() if "NGRAM" in e["guided_with_speculative"]["allowed_modes"]]
    if enabling and allowing and allowing[0] != enabling:  # the code read and the notes must agree
        raise UnrecognizedSource(f"guided + speculative: the notes say {enabling}, the code read {allowing[0]}")
    consumer = tokenizer_info_consumer(upstream.read(REPO, GUIDED_DECODER_CPP, GUIDED_DECODER_COMMIT))
    cpp = cpp_backend_xgrammar(upstream, notes, versions[min(RELEASES, key=_order)])
    needed = set(versions.values())
    for entry in cpp["releases"].values():
        needed |= {entry["xgrammar"]["version"]} if entry["xgrammar"]["version"] else set(entry["xgrammar"]["versions"])
    xgrammar = {v: xgrammar_facts(upstream, v, consumer["xgrammar_calls"]) for v in sorted(needed, key=_order)}
    for release, entry in cpp["releases"].items():  # a release known only within bounds: all of them read alike
        reads = {json.dumps({**xgrammar[v], "source": None}) for v in entry["xgrammar"].get("versions", [])}
        if len(reads) > 1:
            raise UnrecognizedSource(f"{release}: the xgrammar versions it lies between read a tokenizer differently")
    return {
        "note": "Per release, what the PyTorch backend does with guided decoding plus speculative decoding and with "
        "LoRA under CUDA graphs, and the xgrammar it depends on; per C++-backend release 0.19-0.21, the xgrammar "
        "its tensorrtllm backend reads tokenizers with; xgrammar: what each version reads of a tokenizer.",
        "notes_source": cite(REPO, NOTES, NOTES_COMMIT, pinned=False),
        "guided_with_speculative_noted_in": enabling,
        "tokenizer_info_consumer": {"source": cite(REPO, GUIDED_DECODER_CPP, GUIDED_DECODER_COMMIT, pinned=False)}
        | consumer,
        "xgrammar": xgrammar,
        "cpp_backend_xgrammar": cpp,
        "releases": stored_releases(releases),
    }
