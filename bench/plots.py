"""PNG plots of a benchmark run: throughput against concurrency, and latency CDFs."""
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweeps(sweeps: dict[str, list[dict]], baselines: dict[str, float], machine: str, path: Path) -> None:
    """sweeps: {label: [{"concurrency", "tok_s"}, ...]}; baselines: {label: tok/s} drawn as flat lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sweeps.items():
        ax.plot([p["concurrency"] for p in points], [p["tok_s"] for p in points], marker="o", label=label)
    for label, tok_s in baselines.items():
        ax.axhline(tok_s, linestyle="--", color="gray", linewidth=1)
        ax.annotate(label, (1, tok_s), textcoords="offset points", xytext=(4, 4), fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ticks = sorted({p["concurrency"] for points in sweeps.values() for p in points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("requests at once")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput vs concurrency\n{machine}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(samples: dict[str, list[float]], title: str, path: Path) -> None:
    """samples: {"TTFT": [...seconds], "ITL": [...]}, one CDF each."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in samples.items():
        ordered = sorted(values)
        if ordered:
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{label} ({len(ordered)})")
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of samples <= x")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
