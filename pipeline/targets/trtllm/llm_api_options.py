"""TensorRT-LLM's LLM-API options (the `trtllm-serve --extra_llm_api_options` YAML, Triton llmapi `model.yaml`),
per release.

Every key and value the `trtllm` target writes into such a file is checked here against the facts that
scripts/dev/tabulate_trtllm_llm_args.py read from that release's `llm_args.py` (upstream/llm_args.json), because
TorchLlmArgs and its nested configs refuse unknown keys and the keys moved between releases: a file that is
right for one release fails to load on another.
"""

from __future__ import annotations

from pipeline.upstream import release_facts, releases

LLM_API_RELEASES = releases("llm_args")

Problem = tuple[tuple[str, ...], str]


def _release(release: str) -> dict:
    return release_facts("llm_args", release, "The LLM-API options (TorchLlmArgs)")


def serve_options_flag(release: str) -> str:
    """The flag passing the options YAML to `trtllm-serve` of `release`: a spelling every tabulated release accepts
    (1.2 named it --config and kept --extra_llm_api_options as its alias), so that one command line serves them all;
    the release's first spelling where no spelling is common."""
    flags = _release(release)["serve"]["options_flags"]
    everywhere = [
        flag for flag in flags if all(flag in _release(r)["serve"]["options_flags"] for r in LLM_API_RELEASES)
    ]
    return (everywhere or flags)[0]


def has_option(release: str, key: tuple[str, ...]) -> bool:
    """Whether `release`'s TorchLlmArgs has the (nested) option `key`, e.g. ("kv_cache_config", "tokens_per_block")."""
    table = _release(release)
    return tuple(key) in _paths(table, table["root"])


def _paths(table: dict, model: str, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], dict]:
    """Every key path of `model` (nested models included) -> its field facts."""
    found = {}
    for name, field in table["models"][model]["fields"].items():
        found[prefix + (name,)] = field
        if field["kind"] == "model" and field["model"] != model:
            found |= _paths(table, field["model"], prefix + (name,))
    return found


def _where(path: tuple[str, ...], release: str) -> str:
    """Where a key that `release` lacks lives: in the same release under a nested config (kv_cache_dtype ->
    kv_cache_config.dtype), under another name path with the same last key, or in other tabulated releases."""
    table = _release(release)
    paths = _paths(table, table["root"])
    flat = "_".join(path)
    moved = [
        p
        for p in paths
        if len(p) > len(path) and flat in ("_".join(p), "_".join([*(k.removesuffix("_config") for k in p[:-1]), p[-1]]))
    ]
    same = [p for p in paths if p[-1] == path[-1] and p != path]
    elsewhere = [
        r for r in LLM_API_RELEASES if r != release and tuple(path) in _paths(_release(r), _release(r)["root"])
    ]
    hints = [f"it is {'.'.join(p)}" for p in moved] or [f"there is {'.'.join(p)}" for p in same[:3]]
    if elsewhere:
        hints.append(f"{', '.join(elsewhere)} {'has' if len(elsewhere) == 1 else 'have'} it")
    return f" ({'; '.join(hints)})" if hints else ""


def options_problems(options: dict, release: str) -> list[Problem]:
    """(key path, message) for every key of `options` that `release`'s TorchLlmArgs would refuse: unknown keys
    (of models that forbid them and whose fields were all read), values outside an enum/Literal, basic type
    mismatches and None where the field is not Optional. Validators that compare fields are not modelled."""
    table = _release(release)
    return _model_problems(table, table["root"], options, (), release)


def _model_problems(table: dict, model: str, data: dict, path: tuple[str, ...], release: str) -> list[Problem]:
    spec = table["models"][model]
    by_key = {}
    for name, field in spec["fields"].items():
        for key in [name, *field.get("aliases", [])]:
            by_key[key] = field
    problems = []
    for key, item in data.items():
        here = path + (key,)
        if key in by_key:
            problems += _value_problems(table, by_key[key], item, here, release)
        elif spec["extra"] == "forbid" and spec["fields_complete"]:
            problems.append((here, f"{'.'.join(here)} is not an LLM-API option in {release}{_where(here, release)}"))
    return problems


def _value_problems(table: dict, field: dict, item, path: tuple[str, ...], release: str) -> list[Problem]:
    name = ".".join(path)
    if item is None:
        return [] if field["nullable"] else [(path, f"{name} may not be null in {release}")]
    kind = field["kind"]
    if kind == "union":
        return _union_problems(table, field, item, path, release)
    if kind == "model":
        if not isinstance(item, dict):
            return [(path, f"{name} must be a mapping ({field['model']}) in {release}, not {item!r}")]
        return _model_problems(table, field["model"], item, path, release)
    if kind == "enum":
        if item in field["choices"]:
            return []
        return [(path, f"{name}: {item!r} is not one of {field['choices']} in {release}")]
    accepted = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "list": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
        "any": lambda v: True,
    }[kind]
    return [] if accepted(item) else [(path, f"{name} must be {kind} in {release}, not {item!r}")]


def _union_problems(table: dict, field: dict, item, path: tuple[str, ...], release: str) -> list[Problem]:
    """A union of speculative configs is chosen by `decoding_type`; any other union accepts what one member does."""
    members = field["members"]
    decoding = table["speculative_decoding_types"]
    if isinstance(item, dict) and "decoding_type" in item and any(m.get("model") in decoding.values() for m in members):
        kind = item["decoding_type"]
        if kind not in decoding:
            return [
                (
                    path + ("decoding_type",),
                    f"{'.'.join(path)}.decoding_type: {kind!r} is not one of {sorted(decoding)} in {release}",
                )
            ]
        model = decoding[kind]
        if model not in table["models"]:
            return []
        rest = (
            item
            if "decoding_type" in table["models"][model]["fields"]
            else {k: v for k, v in item.items() if k != "decoding_type"}
        )
        return _model_problems(table, model, rest, path, release)
    attempts = [
        _value_problems(table, member | {"nullable": field["nullable"]}, item, path, release) for member in members
    ]
    if any(not a for a in attempts):
        return []
    return [(path, f"{'.'.join(path)}: {item!r} matches none of {field['type']} in {release}")]
