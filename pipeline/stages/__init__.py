"""The stages, in build order. Each module in this package follows one contract:

    NAME: str                    its name everywhere: CLI label, lock entry, `<output>/<NAME>/`
    READS: tuple[str, ...]       config paths whose values are inputs (hashed into the lock)
    TOOLS: tuple[str, ...]       distributions whose versions are inputs (the target adds its own)
    SOURCES: tuple[Path, ...]    files it copies into its output or reads as data (its own module, the target's
                                 modules and every `pipeline` module they import are found by `pipeline.lock_sources`)
    applies(cfg) -> str | None   why the stage is skipped for this config, or None when it runs
    deps(cfg) -> list[Path]      files outside the output directory whose contents are inputs
    writes(cfg) -> str           what it writes, for `plan`
    run(cfg, ctx) -> dict        fills ctx.out_dir; returns metrics recorded in the lock
    AFTER: tuple[str, ...]       (optional) the earlier stages whose outputs are inputs; default: all of them
    ON_REQUEST: bool             (optional) run only when asked for (`--until NAME`, or its own command)

A stage does not branch on the target: the target's part is a call on `pipeline.targets.target_of(cfg)`.
A stage reads the outputs of earlier stages through `ctx.upstream(name)`; their output hashes are
inputs too, so a re-run upstream that changes bytes re-runs every later stage reading it (all, unless AFTER says).
"""

from pipeline.stages import deploy, engine, export, import_model, lora, quantize, triton_repo

STAGES = {module.NAME: module for module in (import_model, quantize, export, engine, lora, triton_repo, deploy)}


def selected(until: str | None = None, only: str | None = None) -> list[str]:
    """The stages a build runs, in order: `only`, or every one up to `until` (default: all but those on request)."""
    if only is not None:
        return [only]
    names = list(STAGES)[: list(STAGES).index(until) + 1] if until else list(STAGES)
    return [name for name in names if name == until or not getattr(STAGES[name], "ON_REQUEST", False)]


def inputs_from(name: str) -> list[str]:
    """The earlier stages whose outputs are inputs of `name`."""
    earlier = list(STAGES)[: list(STAGES).index(name)]
    after = getattr(STAGES[name], "AFTER", None)
    return earlier if after is None else [prior for prior in earlier if prior in after]
