"""Quality side by side: every engine of an offline run scored as the quality gate scores ours (`pipeline.quality`),
against the same fp32 reference, on the same evaluation windows and chat set: KL divergence (mean, p99), top-1
agreement, perplexity, and the share of greedy chat answers equal to fp32's. Peers answer through their workers."""

from __future__ import annotations

from pathlib import Path

from pipeline.bench.peers.client import Worker
from pipeline.quality import Model, reference_scores
from pipeline.targets import target_of

REPORTED = (
    "kl_divergence",
    "kl_divergence_p99",
    "top1_agreement",
    "perplexity_increase",
    "chat_kl_divergence",
    "chat_top1_agreement",
    "chat_answer_match",
)


def score_engines(
    cfg, output: Path, ours_name: str, workers: list[Worker], cache: Path, log, others: list[tuple] = ()
) -> list[dict]:
    """One row per engine: ours (the target's own scored engine), our `others` ((name, config, output) of builds of
    the same model, held to the first build's fp32 reference) and each peer worker; transformers is skipped, as it
    is the reference's own fp32 model. The reference runs once, first, and is released before any engine loads."""
    target = target_of(cfg)
    ours, reference = target.scored(cfg, output, output / target.gated_stage, log)
    models = [(ours_name, "ours", ours)]
    for name, other_cfg, other_output in others:
        other = target_of(other_cfg)
        models.append((name, "ours", other.scored(other_cfg, other_output, other_output / other.gated_stage, log)[0]))
    models += [
        (w.spec.name, w.spec.engine, Model(w.spec.name, Path(w.spec.model), w.logits, w.greedy))
        for w in workers
        if w.spec.engine not in ("ours", "transformers")
    ]
    rows = []
    with reference_scores(cfg, reference, output / "import", cache, log, ours.end_id) as stored:
        for name, kind, model in models:
            log(f"scoring {name}")
            report = stored.report(model, log)
            rows.append({"engine": name, "kind": kind, **{k: report[k] for k in REPORTED if k in report}})
    return rows
