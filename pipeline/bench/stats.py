"""Statistics over per-request samples: percentiles, throughput and goodput under latency objectives."""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 with linear interpolation (numpy's default), None when there are no values."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}


def summarize(samples: list[dict], duration_s: float, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    """One load level. A sample: {"ttft_s", "itl_s": [...], "e2e_s", "output_tokens", "error"}.

    Goodput counts the requests that succeeded with TTFT <= slo_ttft_ms and mean inter-token
    latency <= slo_itl_ms, per second of the run.
    """
    ok = [s for s in samples if not s.get("error")]
    itls = [x for s in ok for x in s["itl_s"]]
    good = [
        s
        for s in ok
        if s["ttft_s"] * 1000 <= slo_ttft_ms and (not s["itl_s"] or np.mean(s["itl_s"]) * 1000 <= slo_itl_ms)
    ]
    tokens = sum(s["output_tokens"] for s in ok)
    ms = lambda d: {k: None if v is None else round(v * 1000, 2) for k, v in d.items()}  # noqa: E731
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 3) if duration_s else 0.0,
        "output_token_throughput": round(tokens / duration_s, 2) if duration_s else 0.0,
        "ttft_ms": ms(percentiles([s["ttft_s"] for s in ok])),
        "itl_ms": ms(percentiles(itls)),
        "e2e_ms": ms(percentiles([s["e2e_s"] for s in ok])),
        "goodput": round(len(good) / duration_s, 3) if duration_s else 0.0,
        "goodput_fraction": round(len(good) / len(samples), 4) if samples else 0.0,
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
    }
