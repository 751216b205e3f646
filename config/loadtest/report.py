"""Turn a load run's per-request records into result.json, report.md and PNG plots, optionally against an
earlier run.

Plots use matplotlib `Figure` objects, never pyplot's global state, so no display is needed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from config.loadtest.loadgen import RequestRecord

RESULT_FILE = "result.json"
SAMPLES_FILE = "samples.json"
REPORT_FILE = "report.md"
PLOT_FILES = ("ttft_cdf.png", "itl_cdf.png", "throughput.png")


@dataclass(slots=True)
class Run:
    """One run as read back from disk: its summary and its raw records."""

    label: str
    summary: dict[str, Any]
    records: list[RequestRecord]


def latency_stats_ms(values_s: list[float] | np.ndarray) -> dict[str, float | None]:
    """p50/p90/p99/mean in milliseconds (linear interpolation); None when there is no sample."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3), "mean": round(float(arr.mean()), 3)}


def ttft_samples(records: list[RequestRecord]) -> np.ndarray:
    return np.array([r.ttft for r in records if r.ok and r.ttft is not None], dtype=np.float64)


def itl_samples(records: list[RequestRecord]) -> np.ndarray:
    """Gaps between consecutive content chunks of successful requests, in seconds."""
    gaps = [np.diff(np.asarray(r.chunk_times)) for r in records if r.ok and len(r.chunk_times) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def e2e_samples(records: list[RequestRecord]) -> np.ndarray:
    return np.array([r.e2e for r in records if r.ok and r.e2e is not None], dtype=np.float64)


def _sig(x: float, digits: int = 6) -> float:
    """`x` to `digits` significant digits: rates stay exact relative to the run however small."""
    return float(f"{x:.{digits}g}")


def _error_examples(records: list[RequestRecord]) -> dict[str, str]:
    """One server message per error key, to tell apart e.g. 503 shed from 503 no worker."""
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.detail and r.error not in examples:
            examples[r.error] = r.detail
    return dict(sorted(examples.items()))


def summarize(records: list[RequestRecord], duration_s: float, meta: dict[str, Any]) -> dict[str, Any]:
    """The result.json body: `meta` (workload, n, concurrency, ...) plus the run's numbers."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if not r.ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    return {
        **meta,
        "n": len(records),
        "duration_s": round(duration_s, 6),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "error_examples": _error_examples(records),
        "requests_per_s": _sig(len(ok) / duration_s),
        "output_tokens_per_s": _sig(output_tokens / duration_s),
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_cached_tokens": cached_tokens,
        "cached_fraction": _sig(cached_tokens / prompt_tokens) if prompt_tokens else 0.0,
        "usage_reported": sum(r.usage_reported for r in ok),
        "ttft_ms": latency_stats_ms(ttft_samples(records)),
        "itl_ms": latency_stats_ms(itl_samples(records)),
        "e2e_ms": latency_stats_ms(e2e_samples(records)),
        "samples_file": SAMPLES_FILE,
    }


def throughput_series(records: list[RequestRecord],
                      bin_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s over run time: (bin start times, rates).

    Each content chunk of a successful request carries an equal share of that
    request's reported completion tokens, so the series integrates to the total.
    """
    times, weights = [], []
    for r in records:
        if r.ok and r.chunk_times:
            share = r.completion_tokens / len(r.chunk_times)
            times.extend(r.start + t for t in r.chunk_times)
            weights.extend([share] * len(r.chunk_times))
    if not times:
        return np.zeros(0), np.zeros(0)
    end = max(times)
    if bin_s is None:
        bin_s = max(end / 60.0, 0.05)
    edges = np.arange(0.0, end + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def _record_to_json(r: RequestRecord) -> dict[str, Any]:
    d = asdict(r)
    for key in ("start", "ttft", "e2e"):
        if d[key] is not None:
            d[key] = round(d[key], 6)
    d["chunk_times"] = [round(t, 6) for t in r.chunk_times]
    return d


def save_run(out_dir: Path, summary: dict[str, Any], records: list[RequestRecord]) -> None:
    """Write result.json and samples.json into `out_dir` (created if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    samples = {"records": [_record_to_json(r) for r in records]}
    (out_dir / SAMPLES_FILE).write_text(json.dumps(samples, separators=(",", ":")) + "\n")


def load_run(run_dir: Path) -> Run:
    """Read a run written by `save_run`; a clear error when the directory holds none."""
    result_path = run_dir / RESULT_FILE
    if not result_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no {RESULT_FILE}: not a bench output directory")
    summary = json.loads(result_path.read_text())
    samples_path = run_dir / summary.get("samples_file", SAMPLES_FILE)
    if not samples_path.is_file():
        raise FileNotFoundError(f"{samples_path} is missing: cannot overlay {run_dir}")
    raw = json.loads(samples_path.read_text())["records"]
    records = [RequestRecord(**d) for d in raw]
    return Run(label=summary.get("label") or run_dir.resolve().name, summary=summary, records=records)


def _ecdf(ax: Any, values_s: np.ndarray, label: str) -> None:
    if values_s.size == 0:
        return
    xs = np.sort(values_s) * 1000.0
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=f"{label} (n={xs.size})")


def _save_cdf_plot(path: Path, runs: list[Run], extract: Any, title: str, xlabel: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    for run in runs:
        _ecdf(ax, extract(run.records), run.label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")


def _save_throughput_plot(path: Path, runs: list[Run]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    for run in runs:
        xs, ys = throughput_series(run.records)
        if xs.size:
            ax.step(xs, ys, where="post",
                    label=f"{run.label} (mean {run.summary['output_tokens_per_s']:.1f} tok/s)")
    ax.set_title("Output tokens/s over time")
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")


def write_plots(out_dir: Path, runs: list[Run]) -> list[Path]:
    """TTFT CDF, ITL CDF and tokens/s timeline, every run in `runs` overlaid."""
    paths = [out_dir / name for name in PLOT_FILES]
    _save_cdf_plot(paths[0], runs, ttft_samples, "Time to first token (CDF)", "TTFT (ms)")
    _save_cdf_plot(paths[1], runs, itl_samples, "Inter-token latency (CDF)", "ITL (ms)")
    _save_throughput_plot(paths[2], runs)
    return paths


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("duration (s)", ("duration_s",)),
    ("requests/s", ("requests_per_s",)),
    ("output tokens/s", ("output_tokens_per_s",)),
    ("output tokens", ("total_output_tokens",)),
    ("prompt tokens", ("total_prompt_tokens",)),
    ("cached fraction of prompt", ("cached_fraction",)),
    *((f"{name} {p} (ms)", (f"{name}_ms", p))
      for name in ("ttft", "itl", "e2e") for p in ("p50", "p90", "p99")),
)


def _lookup(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def render_markdown(runs: list[Run]) -> str:
    """report.md: settings, a numbers table (one column per run) and the plots."""
    main = runs[0].summary
    lines = [
        f"# switchyard bench: {runs[0].label}", "",
        f"Workload `{main.get('workload')}`, model `{main.get('model')}`, n={main.get('n')}, "
        f"concurrency={main.get('concurrency')}, max_tokens={main.get('max_tokens')}, "
        f"seed={main.get('seed')}, "
        f"against `{main.get('url')}` at {main.get('started_at', '?')}.", "",
        "| metric | " + " | ".join(r.label for r in runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    for title, path in _ROWS:
        lines.append(f"| {title} | " + " | ".join(_fmt(_lookup(r.summary, path)) for r in runs) + " |")
    lines += ["", "## Errors", ""]
    for run in runs:
        errors = run.summary.get("errors") or {}
        text = ", ".join(f"`{k}`: {v}" for k, v in errors.items()) or "none"
        lines.append(f"- {run.label}: {text}")
        examples = run.summary.get("error_examples") or {}
        lines += [f"  - `{k}` e.g. {msg!r}" for k, msg in examples.items()]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in PLOT_FILES] + [""]
    return "\n".join(lines)


def write_report(out_dir: Path, compare_dir: Path | None = None) -> list[Path]:
    """report.md and the PNGs for the run in `out_dir`, overlaying `compare_dir` when given."""
    runs = [load_run(out_dir)]
    if compare_dir is not None:
        other = load_run(compare_dir)
        if other.label == runs[0].label:
            other.label += " (compare)"
        runs.append(other)
    paths = write_plots(out_dir, runs)
    report = out_dir / REPORT_FILE
    report.write_text(render_markdown(runs))
    return [report, *paths]
