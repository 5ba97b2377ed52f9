"""The inspection verbs: what this installation can build, from the target and architecture registries."""

from __future__ import annotations

from rich.table import Table

from pipeline.architectures import ARCHITECTURES
from pipeline.cli.common import console


def targets():
    """List the registered targets: what each builds, whether this machine can build and run its engines,
    and the config fields it does not honour (setting one of those for it is a `validate` error).

    Example: trtllm-pipeline targets
    """
    from pipeline.config import BuildConfig, leaf_field_paths
    from pipeline.targets import TARGETS, honoured

    for name, target in TARGETS.items():
        unavailable = target.unavailable()
        refused = [path for path in leaf_field_paths(BuildConfig) if not honoured(path, target.honours)]
        console.print(
            f"[bold]{name}[/]: {target.summary}\n  on this machine: "
            + (f"[yellow]{unavailable}[/]" if unavailable else "[green]available[/]")
            + f"\n  refuses (a validate error when set): {', '.join(refused)}",
            highlight=False,
            soft_wrap=True,
        )


def architectures():
    """List the registered model architectures (Hugging Face `architectures` names), what sets each family apart,
    and which target, backend and TensorRT-LLM release builds it; a refusal says why. `validate` refuses a
    checkpoint whose architecture the config's target cannot build, naming the supported ones.

    Example: trtllm-pipeline architectures
    """
    from pipeline.config import BuildConfig
    from pipeline.targets import TARGETS

    columns: dict[str, dict[str, list]] = {}  # column -> architecture -> [(release or "", why not)]
    for name, target in TARGETS.items():
        for variant in target.variants():
            release = variant.get("trtllm_version", "")
            column = " ".join([name, *(v for k, v in variant.items() if k != "trtllm_version")])
            support = target.architecture_support(BuildConfig(target={"name": name, **variant}))
            for arch, why_not in support.items():
                columns.setdefault(column, {}).setdefault(arch, []).append((release, why_not))
    table = Table(title="registered architectures", title_justify="left")
    table.add_column("architecture", no_wrap=True)
    table.add_column("family")
    for heading in columns:
        table.add_column(heading)
    refusals: dict[str, str] = {}
    for arch in ARCHITECTURES.values():
        cells = []
        for column, by_arch in columns.items():
            taken = [release for release, why_not in by_arch[arch.name] if why_not is None]
            refused = [(release, why_not) for release, why_not in by_arch[arch.name] if why_not is not None]
            if refused:  # the newest refused release's reason (it names its release); `validate` names each one's
                releases = " ".join(release for release, _ in refused)
                refusals[f"{arch.name} on {column}{f' (refused in {releases})' if releases else ''}"] = refused[-1][1]
            cells.append(("[green]" + (" ".join(taken) or "yes") + "[/]") if taken else "[yellow]refused[/]")
        table.add_row(arch.name, arch.family, *cells)
    console.print(table)
    for arch in ARCHITECTURES.values():
        console.print(f"  {arch.family}: {arch.traits}", highlight=False, soft_wrap=True)
    for where, why_not in refusals.items():
        console.print(f"  {where}: {why_not}", highlight=False, soft_wrap=True)
