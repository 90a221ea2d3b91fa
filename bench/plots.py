"""PNG plots for the benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _cdf(ax, samples_s: list[float], label: str) -> None:
    if not samples_s:
        return
    x = np.sort(np.asarray(samples_s) * 1e3)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def serve_plots(result: dict, out: Path, name: str) -> list[Path]:
    """`<name>-throughput.png` (tokens/s and req/s against streams) and `<name>-latency.png`
    (TTFT and inter-token latency distributions, one curve per concurrency)."""
    levels = result["levels"]
    c = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(c, [lv["tokens_per_s"] for lv in levels], "o-", label="generated tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(c, [str(x) for x in c])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(c, [lv["requests_per_s"] for lv in levels], "s--", color="tab:orange", label="requests/s")
    ax2.set_ylabel("requests/s")
    protocol = "HTTP" if result.get("protocol") == "http" else "gRPC"
    ax.set_title(f"attnserve over {protocol}: throughput ({result['workload']} workload)")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [out / f"{name}-throughput.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for lv in levels:
        label = f"{lv['concurrency']} stream{'s' if lv['concurrency'] != 1 else ''}"
        _cdf(a, lv["ttft_samples_s"], label)
        _cdf(b, lv["itl_samples_s"], label)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_title("time to first token")
    b.set_title("inter-token latency")
    for ax in (a, b):
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out / f"{name}-latency.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def compare_plot(result: dict, out: Path) -> Path:
    """One row of panels per size: batch-1 tokens/s and 32-stream aggregate tokens/s, one bar per system
    and precision (attnserve's in a colour of their own)."""
    sizes = [info["size"] for info in result["sizes"]]
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 0.9 + 0.28 * max(
        (sum(1 for r in result["rows"] if r["size"] == s) for s in sizes), default=1) * len(sizes) + 0.6 * len(sizes)),
        squeeze=False)
    for row_axes, size in zip(axes, sizes, strict=True):
        rows = [r for r in result["rows"] if r["size"] == size]
        labels = [f"{r['system']} {r['precision']}" for r in rows]
        colours = ["tab:red" if r["ours"] else "tab:blue" for r in rows]
        y = np.arange(len(rows))
        for ax, field, title in ((row_axes[0], "single_tokens_per_s", "batch 1"),
                                 (row_axes[1], "streams_tokens_per_s", "32 streams")):
            ax.barh(y, [r[field] or 0 for r in rows], color=colours)
            ax.set_yticks(y, labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_title(f"{size}: {title}", fontsize=9)
            ax.set_xlabel("generated tokens/s", fontsize=8)
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Same weights, same prompts, same greedy tokens, one interleaved run", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title above the panels
    path = out / "compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
