"""The bench figure: tokens/s per method (median, error bars = std over runs, dots = runs), and the measured speedup
over plain decoding against K next to the theoretical curves. Uses matplotlib's Agg canvas directly, so no GUI
backend and no global pyplot state are involved."""

from __future__ import annotations

from pathlib import Path

from . import stats as st

COLORS = {"specdecode-plain": "#8c8c8c", "specdecode": "#1f77b4", "hf-plain": "#d9a066", "hf-assisted": "#d62728"}


def plot_report(report: dict, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    sweep = report.get("sweep", [])
    speculative = [c for c in sweep if "specdecode" in c["methods"] or "hf-assisted" in c["methods"]]
    fig = Figure(figsize=(12.5, 5.0) if speculative else (7.0, 5.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    if speculative:
        ax_bars, ax_k = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    else:
        ax_bars, ax_k = fig.subplots(1, 1), None
    _bars(ax_bars, report)
    if ax_k is not None:
        _speedup_vs_k(ax_k, report)
    config = report.get("config", {})
    title = f"{config.get('target', 'target')}"
    if config.get("draft"):
        title += f"  ←  draft {config['draft']}"
    title += (f"   |   prompts: {config.get('prompts', '?')} ({config.get('num_prompts', '?')}), "
              f"{config.get('max_new_tokens', '?')} new tokens, {config.get('runs', '?')} run(s)")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _bars(ax, report: dict) -> None:
    methods = report["methods"]
    names = list(methods)
    medians = [methods[n]["tokens_per_second"] for n in names]
    stds = [methods[n]["tokens_per_second_std"] for n in names]
    runs = [methods[n]["tokens_per_second_runs"] for n in names]
    xs = list(range(len(names)))
    ax.bar(xs, medians, yerr=[[min(s, m) for m, s in zip(medians, stds)], stds], capsize=6,
           color=[COLORS.get(n, "#555555") for n in names], alpha=0.85, edgecolor="black", linewidth=0.6,
           error_kw={"elinewidth": 1.0})
    for x, values in zip(xs, runs):
        ax.scatter([x] * len(values), values, color="black", s=10, zorder=3)
    heads = [max([m + s] + r) for m, s, r in zip(medians, stds, runs)]
    top = max(heads, default=1.0) or 1.0
    for x, n, m, head in zip(xs, names, medians, heads):
        label = f"{m:.3g} tok/s"
        block = methods[n]
        if "speedup_vs" in block and block["speedup_vs"].get("specdecode-plain"):
            label += f"\n{block['speedup_vs']['specdecode-plain']:.2f}× ours plain"
        if "acceptance_rate" in block:
            label += f"\naccept {block['acceptance_rate']:.0%}"
        ax.text(x, head + top * 0.02, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, names, fontsize=9)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("tokens / s  (bar: median, whiskers: ± std, dots: runs)")
    k, t = report.get("k"), report.get("temperature")
    ax.set_title("throughput" + (f", K={k}" if k is not None else "") + (f", T={t:g}" if t is not None else ""),
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _speedup(config: dict, name: str, plain: str):
    if name not in config["methods"] or plain not in config["methods"]:
        return None
    return config["methods"][name]["speedup_vs"].get(plain)


def _speedup_vs_k(ax, report: dict) -> None:
    sweep = report["sweep"]
    costs = report.get("costs", {})
    temperatures = list(dict.fromkeys(c["temperature"] for c in sweep))
    all_k = sorted({c["k"] for c in sweep if c["k"] != "auto"})
    k_max = max(all_k + [8])
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]
    for i, t in enumerate(temperatures):
        many = len(temperatures) > 1
        suffix = f", T={t:g}" if many else ""
        at_t = [c for c in sweep if c["temperature"] == t]
        configs = sorted((c for c in at_t if c["k"] != "auto"), key=lambda c: c["k"])
        for name, plain, style in (("specdecode", "specdecode-plain", "-"), ("hf-assisted", "hf-plain", "-.")):
            color = palette[i % len(palette)] if many else COLORS[name]
            pts = [(c["k"], _speedup(c, name, plain)) for c in configs]
            pts = [(k, s) for k, s in pts if s is not None]
            if pts:
                ax.plot([k for k, _ in pts], [s for _, s in pts], linestyle=style, marker="o" if name ==
                        "specdecode" else "s", color=color, label=f"{name} measured{suffix}")
            for c in at_t:  # K = auto has no place on the K axis: a level line
                speedup = _speedup(c, name, plain) if c["k"] == "auto" else None
                if speedup is not None:
                    ax.axhline(speedup, linestyle=style, color=color, alpha=0.6, linewidth=1.2,
                               label=f"{name} K=auto measured{suffix}")
        theory = next((c["theory"] for c in configs if c.get("theory")), None)  # fixed K only
        if theory is not None and costs.get("c") is not None:
            alpha, c = theory["alpha"], costs["c"]
            ks = list(range(1, k_max + 1))
            color = palette[i % len(palette)] if many else "#2ca02c"
            ax.plot(ks, [st.expected_speedup(alpha, k, c) for k in ks], linestyle="--", color=color, alpha=0.8,
                    label=f"theory v=1 (α={alpha:.2f}, c={c:.2f}){suffix}")
            vks = sorted(int(k) for k in costs.get("v", {}))
            if vks:
                color = palette[i % len(palette)] if many else "#9467bd"
                ax.plot(vks, [st.expected_speedup(alpha, k, c, costs["v"][str(k)]) for k in vks], linestyle=":",
                        marker=".", color=color, label=f"theory, measured v(K){suffix}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per verification)")
    ax.set_ylabel("speedup over the same library's plain decoding")
    ax.set_xticks(list(range(1, k_max + 1)))
    ax.set_title("speedup vs K (measured, and (1−α^(K+1)) / ((1−α)(Kc+v)))", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
