"""`--plot FILE.png`: one figure per benchmark report, ours beside the baseline.

matplotlib (the `bench` extra) draws it; it is imported only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OURS_COLOR, BASELINE_COLOR = "tab:blue", "tab:orange"


class PlotUnavailable(Exception):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'compiled_engine[bench]'") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def check_plotting() -> None:
    _pyplot()


def _bars(ax: Any, title: str, labels: list[str], ours: list[float], baseline: list[float | None]) -> None:
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="ours", color=OURS_COLOR)
    if any(v is not None for v in baseline):
        ax.bar([i + 0.2 for i in x], [v or 0.0 for v in baseline], width=0.4, label="hf", color=BASELINE_COLOR)
    ax.set_xticks(list(x), labels)
    ax.set_title(title)
    ax.legend()


def _cdf(ax: Any, values: list[float], label: str, color: str, style: str = "-") -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.step(
        ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], style, where="post", label=label, color=color
    )


def _latency_figure(plt: Any, report: dict[str, Any]) -> Any:
    results = report["results"]
    ours, hf = results["ours"], results.get("hf", {})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    _bars(axes[0], "prefill tokens/s", ["prefill"], [ours["prefill_tokens_per_s"]], [hf.get("prefill_tokens_per_s")])
    _bars(
        axes[1], "batch-1 decode tokens/s", ["decode"], [ours["decode_tokens_per_s"]], [hf.get("decode_tokens_per_s")]
    )
    ceiling = report["bandwidth_ceiling_bytes_per_s"] / ours["weight_bytes"]
    axes[1].axhline(ceiling, linestyle="--", color="gray", label="bandwidth ceiling")
    axes[1].legend()
    return fig


def _offline_figure(plt: Any, report: dict[str, Any]) -> Any:
    results = report["results"]
    ours, hf = results["ours"], results.get("hf", {})
    fig, ax = plt.subplots(1, 1, figsize=(6, 4))
    keys = ["output_tokens_per_s", "total_tokens_per_s"]
    _bars(
        ax,
        f"offline, {report['workload']['num_seqs']} requests",
        ["output tokens/s", "total tokens/s"],
        [ours[k] for k in keys],
        [hf.get(k) for k in keys],
    )
    return fig


def _serve_figure(plt: Any, report: dict[str, Any]) -> Any:
    points = [p for p in report["results"] if p.get("prompts", "fresh") == "fresh"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for side, color in (("ours", OURS_COLOR), ("hf", BASELINE_COLOR), ("llama_server", BASELINE_COLOR)):
        runs = [(p["load"], p[side]) for p in points if "output_tokens_per_s" in p.get(side, {})]
        if not runs:
            continue
        axes[0].plot(
            [load for load, _ in runs],
            [r["output_tokens_per_s"] for _, r in runs],
            "o-",
            label=side.replace("_", "-"),
            color=color,
        )
        heaviest = runs[-1][1]["samples"]
        _cdf(axes[1], heaviest["ttft_s"], side.replace("_", "-"), color)
        _cdf(axes[2], heaviest["e2e_s"], side.replace("_", "-"), color)
    axes[0].set_xlabel(report["workload"]["sweep"])
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    for ax, what in ((axes[1], "TTFT"), (axes[2], "end-to-end latency")):
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{what} CDF at {points[-1]['load']}")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return fig


def write_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    figure = {"latency": _latency_figure, "offline": _offline_figure, "serve": _serve_figure}[report["benchmark"]]
    fig = figure(plt, report)
    fig.suptitle(
        f"compiled_engine bench {report['benchmark']} ({report['environment']['device']}, {report['environment']['dtype']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
