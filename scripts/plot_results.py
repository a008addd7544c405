"""The results page's summary table and figures, made from the measurements in docs/results/.

    python scripts/plot_results.py            # writes every figure into docs/img/
    python scripts/plot_results.py --table    # prints the summary table (docs/RESULTS.md and the README hold it)
    python scripts/plot_results.py --out DIR  # the figures into DIR instead
    python scripts/plot_results.py --matrix peer-matrix-xeon.json   # a matrix run's table (the results page's)
    python scripts/plot_results.py --aider aider-edits-amd-epyc-avx512.json   # an aider run's table
    python scripts/plot_results.py --corpus corpus-amd-epyc-avx512.json   # a `bench serve --workload corpus` run's

Every number comes from a file of docs/results/; what a file does not say (the hardware, the peer, the date, the
command that made it) is written next to it here, once, and printed with it. tests/test_docs_results.py checks that
the table in docs/RESULTS.md and in the README is this script's and that every figure in docs/img is one of these
(or the playground's screenshot, made by scripts/playground_screenshot.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
IMG = ROOT / "docs" / "img"

EPYC = "2-vCPU AMD EPYC (AVX-512)"
XEON = "2-vCPU Intel Xeon (AVX-512)"
MATRIX_XEON = "peer-matrix-xeon.json"  # `specdecode bench serve --workload matrix`, 256 tokens an answer
# The matrix runs whose tables the results page shows (each file's table is `--matrix FILE`'s)
EPYC_MATRIX = tuple(f"peer-matrix-amd-epyc-avx512-{run}.json" for run in (1, 2, 3))
# ...and a run after the grammar's greedy step took llama.cpp's argmax, ours with `--json-layout model` (JSON laid out
# as llama-server's json_schema lets the model lay it out: the same text on both): on the page, not in the summary
EPYC_MATRIX_MODEL_LAYOUT = "peer-matrix-amd-epyc-avx512-json-layout-model.json"
MATRIX_TABLES = (MATRIX_XEON, *EPYC_MATRIX, EPYC_MATRIX_MODEL_LAYOUT)
AIDER_TABLES = ("aider-edits-amd-epyc-avx512.json",)  # scripts/aider_edit_check.py's runs the results page shows
# The summary's matrix runs per CPU: (files, hardware, max_tokens, date), each file a run on fresh servers; a row
# gives the medians over the files of our rate and of the best peer's. Their tables are the results page's.
MATRIX_RUNS = (((MATRIX_XEON,), XEON, 256, "2026-12-03"),
               (EPYC_MATRIX, EPYC, 256, "2026-12-04"))
# `specdecode bench serve --workload corpus` runs (what a user waits for, end to end, on work nothing was tuned on):
# the summary's CPU rows, one a kind, and the results page's tables: (file, date)
CORPUS_RUNS = (("corpus-xeon-2026-12-07.json", "2026-12-07"),)
CORPUS_COMMAND = ("`specdecode bench serve --workload corpus --serve \"--threads 2\" --peer-gguf "
                  "qwen2.5-coder-1.5b-instruct --llama-server PATH --threads 2 {options}`")
H200 = "NVIDIA H200"
OURS, PEER, OURS_PLAIN = "#2a7ab9", "#9a9a9a", "#8fc1e3"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Row:
    """One line of the summary: ours against the best peer measured on the same weights and hardware."""

    hardware: str
    workload: str
    ours: str
    peer: str
    ours_value: float
    peer_value: float
    unit: str  # "tok/s" (higher is better) or "s" (lower is better)
    date: str
    command: str
    source: str  # the docs/results file
    also: tuple[str, ...] = ()  # further files of the same figure (other runs its medians are over)

    @property
    def speedup(self) -> float:
        return self.ours_value / self.peer_value if self.unit == "tok/s" else self.peer_value / self.ours_value

    def result(self) -> str:
        largest = max(self.ours_value, self.peer_value)
        digits = 1 if self.unit == "tok/s" else 2 if largest < 10 else 1 if largest < 100 else 0
        figure = f"{self.ours_value:.{digits}f} vs {self.peer_value:.{digits}f} {self.unit}"
        verdict = f"**{self.speedup:.2f}×**" + (" (slower)" if self.speedup < 0.995 else "")
        return f"{figure}: {verdict}"

    def markdown(self, dated: bool = True) -> str:
        cells = (self.hardware, self.workload, self.ours, self.peer, self.result(), *((self.date,) if dated else ()),
                 self.command)
        return "| " + " | ".join(cells) + " |"


def _tok_s(data: dict, method: str) -> float:
    return data["methods"][method]["tokens_per_second"]


def summary_rows() -> list[Row]:
    """Ours against the best peer measured in the same run on the current code: the corpus runs' kinds (every
    llama-server mode and plain, end to end), and the one GPU figure."""
    h200 = load("device-probe-transformers-h200.json")
    return [
        *(row for source, date in CORPUS_RUNS for row in corpus_rows(source, date)),
        Row(H200, "128 tokens, random weights (1.5B shape), every draft kept, K = 4",
            "transformers backend", "transformers' assisted generation",
            statistics.median(h200["times_ms"]["ours_spec"]) / 1000,
            statistics.median(h200["times_ms"]["hf_assisted"]) / 1000, "s", "2026-11-26",
            "`python scripts/device_probes/transformers_assisted.py`", "device-probe-transformers-h200.json"),
    ]


MATRIX_COMMAND = ("`specdecode bench serve --workload matrix --url URL --llama-server PATH --peer-gguf "
                  "qwen2.5-coder-1.5b-instruct --draft-gguf qwen2.5-coder-0.5b-instruct --threads 2 --max-tokens 128`")


def matrix_rows() -> list[Row]:
    """The matrix's rename edit and novel code on each CPU: ours against the best llama-server mode (plain included)."""
    rows = []
    for sources, hardware, tokens, measured in MATRIX_RUNS:
        runs = [{row["workload"]: row for row in load(source)["summary"]} for source in sources]
        for workload, label in (("edit: rename", f"whole-file rename (bisect.py), {tokens} tokens"),
                                ("novel code", f"novel code (chat), {tokens} tokens")):
            modes = sorted({_best_mode(run[workload]) for run in runs})
            spec = [m for m in modes if m != "plain"]
            named = [f"`--spec-type {m}`" if i == 0 else f"`{m}`" for i, m in enumerate(spec)]
            peer = "llama-server " + " / ".join(named + ["plain"] * ("plain" in modes))
            label += f", median of {len(runs)} runs" if len(runs) > 1 else ""
            rows.append(Row(hardware, label, "`specdecode serve` defaults", f"{peer} (best of 6)",
                            statistics.median(run[workload]["ours"] for run in runs),
                            statistics.median(run[workload]["best_peer_tok_s"] for run in runs), "tok/s", measured,
                            MATRIX_COMMAND.replace("--max-tokens 128", f"--max-tokens {tokens}"), sources[0],
                            sources[1:]))
    return rows


def _best_mode(row: dict) -> str:
    """The llama-server mode of a matrix row's best peer figure: a --spec-type, or plain."""
    return _mode(row["best_mode"]) if row["best_mode_tok_s"] == row["best_peer_tok_s"] else "plain"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}×" + (" (slower)" if round(ratio, 2) < 1 else "")


def _mode(server: str) -> str:
    return "plain" if server == "llama-server" else server.removeprefix("llama-server ")


def matrix_table(source: str) -> str:
    """A matrix run as the results page shows it: per workload our decode rate, llama-server plain's and its best
    mode's, the ratios, and the time to each whole answer (ours against the fastest peer's)."""
    columns = ["workload", "ours", "llama-server plain", "best llama-server mode", "ours / plain", "ours / best peer",
               "answer time: fastest peer / ours"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in load(source)["summary"]:
        lines.append(f"| {row['workload']} | {row['ours']:.1f} | {row['plain']:.1f} | {row['best_peer_tok_s']:.1f} "
                     f"({_best_mode(row)}) | {row['vs_plain']:.2f}× | {_x(row['vs_best'])} | "
                     f"{row['fastest_peer_s']:.1f} s vs {row['ours_s']:.1f} s ({_mode(row['fastest_peer'])}): "
                     f"{_x(row['time_vs_fastest'])} |")
    return "\n".join(lines)


def aider_table(source: str) -> str:
    """scripts/aider_edit_check.py's run as the results page shows it: per edit, seconds per edit on each server
    (medians over the rounds), ours against each, and how many edited files were exactly the edit asked for."""
    report = load(source)
    servers = list(dict.fromkeys(row["server"] for row in report["summary"]))
    names = ["llama-server plain" if s == "llama-server" else s for s in servers]
    lines = ["| edit | " + " | ".join(names) + " | ours / fastest peer | exactly as asked | same file as llama-server "
             "plain's |",
             "|" + "---|" * (len(servers) + 4)]
    for edit in dict.fromkeys(row["edit"] for row in report["summary"]):
        rows = {row["server"]: row for row in report["summary"] if row["edit"] == edit}
        fastest = min((s for s in servers if s != "ours"), key=lambda s: rows[s]["median_s"])
        cells = [f"{rows[s]['median_s']:.1f} s" for s in servers]
        asked = ", ".join(f"{rows[s]['as_asked']}/{rows[s]['runs']}" for s in servers)
        same = ", ".join("yes" if rows[s]["same_text_as_llama_server_plain"] else "no" for s in servers)
        speedup = rows[fastest]["median_s"] / rows["ours"]["median_s"]
        lines.append(f"| {edit} | " + " | ".join(cells) + f" | {_x(speedup)} ({_mode(fastest)}) | {asked} | {same} |")
    return "\n".join(lines)


def aider_row(source: str) -> Row:
    """aider's two whole-file edits: our seconds for both against the fastest llama-server mode's on each."""
    summary = load(source)["summary"]
    edits = list(dict.fromkeys(row["edit"] for row in summary))
    ours = sum(row["median_s"] for row in summary if row["server"] == "ours")
    best = sum(min(row["median_s"] for row in summary if row["edit"] == e and row["server"] != "ours") for e in edits)
    return Row(EPYC, f"aider: {len(edits)} whole-file edits of bisect.py", "`specdecode serve` defaults",
               "llama-server's fastest mode per edit", ours, best, "s",
               "2026-12-04", "`python scripts/aider_edit_check.py --aider PATH --rounds 2`", source)


CORPUS_GROUPS = (("whole-file edits", "edit: "), ("chat, back to back", "(back to back)"),
                 ("chat, 2 s think-time", "(think"))  # a summary row each: (label, what its kinds' names hold)


def corpus_rows(source: str, date: str) -> list[Row]:
    """A corpus run in a few rows (edits, chats back to back, chats with a think-time): our median seconds a request
    (to its last token) summed over the group's kinds, against the fastest llama-server mode's (plain included) of
    each kind, summed: every kind against its own best peer. Each kind's row is the results page's table."""
    report = load(source)
    config = report["config"]
    peers = [s for s in config["servers"] if s != "ours"]
    modes = ", ".join(_mode(p) for p in peers)
    options = (f"--modules {len(report['modules'])} --edit-kinds \"{','.join(config['edit_kinds'])}\" --chat-kinds "
               f"{','.join(config['chat_kinds'])} --spec-types "
               f"{','.join(_mode(p) for p in peers if p != 'llama-server')}")
    rows = []
    for label, marker in CORPUS_GROUPS:
        kinds = [k for k in report["summary"] if marker in k["kind"] and k["best_peer"]
                 and k["servers"]["ours"]["seconds"] is not None]
        if not kinds:
            continue
        ours = sum(k["servers"]["ours"]["seconds"] for k in kinds)
        best = sum(k["servers"][k["best_peer"]]["seconds"] for k in kinds)
        rows.append(Row(config["hardware"], f"{label}: {len(kinds)} kinds, seconds to the last token, medians of "
                        f"{_rounds_done(report)} rounds", "`specdecode serve` defaults",
                        f"llama-server's fastest mode per kind (of {modes})", ours, best, "s", date,
                        CORPUS_COMMAND.format(options=options), source))
    return rows


def _rounds_done(report: dict) -> int:
    """Rounds every server finished (a run stopped early holds fewer than it asked for)."""
    sessions = report["sessions"]
    return min(sum(1 for x in sessions if x["server"] == s) for s in report["config"]["servers"])


def corpus_table(source: str) -> str:
    """A `bench serve --workload corpus` run (its file of docs/results/) as the results page shows it, under the CPU
    it ran on."""
    from specdecode.bench.corpus_run import markdown_table

    report = load(source)
    config = report["config"]
    return (f"{config['hardware']}, llama.cpp {config['threads']} threads, {_rounds_done(report)} rounds, seconds a "
            f"request to its last token (TTFT):\n\n" + markdown_table(report))


def summary_table(dated: bool = True) -> str:
    """The summary as markdown: with the dates for docs/RESULTS.md, without them for the README."""
    columns = ["hardware", "workload", "specdecode", "against", "result", *(["measured"] if dated else []), "reproduce"]
    header = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([*header, *(row.markdown(dated) for row in summary_rows())])


# ---------------------------------------------------------------------------------------------------- figures


def _axes(width: float = 8.0, height: float = 4.0, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=110)
    return plt, fig, axes


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_summary(path: Path) -> None:
    rows = summary_rows()
    plt, fig, ax = _axes(9.0, 4.2)
    labels = [f"{r.hardware}: {r.workload}\nvs {r.peer.replace('`', '')}" for r in rows]
    speedups = [r.speedup for r in rows]
    colors = [OURS if s >= 1 else "#c0504d" for s in speedups]
    y = range(len(rows))[::-1]
    ax.barh(list(y), speedups, color=colors)
    for yi, s in zip(y, speedups):
        ax.text(s + 0.02, yi, f"{s:.2f}×", va="center", fontsize=9)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlim(0, max(speedups) * 1.18)
    ax.set_xlabel("speed against the peer (× ; below 1: the peer is faster)")
    fig.suptitle("specdecode against the best peer measured on the same weights and hardware", fontsize=10)
    _save(plt, fig, path)


def plot_cpu_tokens(path: Path) -> None:
    """Tokens/s of our plain decoding, our defaults and llama-cpp-python, per prompt set, on the AMD EPYC."""
    sets = [("code", load("defaults-code-after.json"), "llamacpp-plain"),
            ("prose", load("defaults-prose-after.json"), "llamacpp-plain"),
            ("JSON schema", load("defaults-json-after2.json"), "llamacpp-json-schema")]
    plt, fig, ax = _axes(7.5, 3.8)
    width = 0.26
    for i, (name, data, peer) in enumerate(sets):
        values = [_tok_s(data, peer), _tok_s(data, "specdecode-plain"), _tok_s(data, "specdecode")]
        for j, (value, color) in enumerate(zip(values, (PEER, OURS_PLAIN, OURS))):
            ax.bar(i + (j - 1) * width, value, width, color=color)
            ax.text(i + (j - 1) * width, value + 0.5, f"{value:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(sets)), [s[0] for s in sets])
    ax.set_ylabel("tokens/s (end to end)")
    ax.set_ylim(0, 46)
    ax.legend(["llama-cpp-python (its json_schema on JSON)", "specdecode, no draft", "specdecode, defaults"],
              fontsize=8, loc="upper center", ncol=3)
    ax.set_title(f"{EPYC}, llama.cpp, 2 threads, default pair, greedy", fontsize=10)
    _save(plt, fig, path)


def plot_agent(path: Path) -> None:
    methods = load("agent-auto-client-parsed-lat0.json")["methods"]
    names = {"lend": "ours, --answer-kv lend", "default": "ours, defaults", "plain": "ours, --draft none",
             "llamacpp-function-calling": "llama-cpp-python\nfunction calling", "llama-server": "llama-server --jinja"}
    order = ["lend", "default", "plain", "llamacpp-function-calling", "llama-server"]
    seconds = [methods[m]["session_s"] for m in order]
    plt, fig, ax = _axes(7.5, 3.6)
    colors = [OURS, OURS, OURS_PLAIN, PEER, PEER]
    ax.barh(range(len(order))[::-1], seconds, color=colors)
    for yi, s in zip(range(len(order))[::-1], seconds):
        ax.text(s + 2, yi, f"{s:.0f} s", va="center", fontsize=9)
    ax.set_yticks(range(len(order))[::-1], [names[m] for m in order], fontsize=9)
    ax.set_xlim(0, max(seconds) * 1.15)
    ax.set_xlabel("8 coding-agent sessions, seconds (lower is better)")
    ax.set_title(f"{EPYC}: tool calls in auto mode, default pair, 2 threads", fontsize=10)
    _save(plt, fig, path)


def plot_verify_costs(path: Path) -> None:
    """v(n): a forward of n tokens over a forward of 1, where speculation's price is set."""
    cpu = load("tree-verify-costs-default-pair.json")["v"]["chain"]
    sections = load("device-check-h200.json")["sections"]
    many = sections["llamacpp"]["result"]["v"]
    gpu = next(r["v"] for r in sections["costs"]["result"]["rows"]
               if r["size"] == "1.5B" and r["backend"] == "static" and r["batch"] == 1)
    plt, fig, ax = _axes(7.0, 3.8)
    for curve, label, color in ((cpu, f"{EPYC}, llama.cpp, Q4_K_M 1.5B", "#c0504d"),
                                (many, "16-core Intel Xeon (H200 host), llama.cpp, Q4_K_M 1.5B shape", "#e3a21a"),
                                (gpu, f"{H200}, static backend (CUDA graphs), bf16 1.5B shape", OURS)):
        n = sorted(int(k) for k in curve if int(k) <= 9)
        ax.plot(n, [curve[str(i)] for i in n], marker="o", label=label, color=color)
    ax.plot([1, 9], [1, 9], linestyle=":", color="gray", label="n steps (no gain from any draft)")
    ax.set_xlabel("tokens in one forward (K drafts + 1)")
    ax.set_ylabel("cost in one-token steps")
    ax.legend(fontsize=8)
    ax.set_title("What a verification costs: flat pays, steep does not", fontsize=10)
    _save(plt, fig, path)


def plot_prefix_cache(path: Path) -> None:
    warm = load("prefix-cache-multi-turn-default-pair.json")["per_turn"]
    cold = load("prefix-cache-multi-turn-cold-default-pair.json")["per_turn"]
    plt, fig, ax = _axes(6.5, 3.5)
    turns = [t["turn"] for t in warm]
    width = 0.38
    ax.bar([t - width / 2 for t in turns], [t["ttft_median_s"] for t in cold], width, color=PEER,
           label="--prefix-cache-tokens 0")
    ax.bar([t + width / 2 for t in turns], [t["ttft_median_s"] for t in warm], width, color=OURS,
           label="prefix cache on (the default)")
    ax.set_xticks(turns, [f"turn {t}" for t in turns])
    ax.set_ylabel("time to first token, s")
    ax.legend(fontsize=8)
    ax.set_title(f"{EPYC}: a 5-turn chat (~1,000-1,300 prompt tokens)", fontsize=10)
    _save(plt, fig, path)


def plot_batching(path: Path) -> None:
    cont = load("serve-default-pair-128-continuous.json")["ttft_s"]
    static = load("serve-default-pair-128-static.json")["ttft_s"]
    plt, fig, ax = _axes(6.5, 3.5)
    keys = ["p50", "p90", "p99"]
    width = 0.38
    ax.bar([i - width / 2 for i in range(3)], [static[k] for k in keys], width, color=PEER,
           label="--static-batching")
    ax.bar([i + width / 2 for i in range(3)], [cont[k] for k in keys], width, color=OURS,
           label="continuous batching (the default)")
    ax.set_xticks(range(3), keys)
    ax.set_ylim(0, max(static.values()) * 1.3)
    ax.set_ylabel("time to first token, s")
    ax.legend(fontsize=8)
    ax.set_title(f"{XEON}: 14 requests of 128 tokens at 0.06 req/s", fontsize=10)
    _save(plt, fig, path)


def plot_soak_memory(path: Path) -> None:
    runs = [("tiny models, transformers", load("soak-bounds-tiny-transformers.json")),
            ("SmolLM2-135M, llama.cpp", load("soak-bounds-smollm2-llamacpp.json"))]
    plt, fig, axes = _axes(9.0, 3.4, ncols=2)
    for ax, (name, data) in zip(axes, runs):
        samples = data["memory_samples"]
        t = [s["t_s"] / 60 for s in samples]
        ax.plot(t, [s["rss_bytes"] / 2**20 for s in samples], color=OURS, label="RSS")
        ax.plot(t, [s["malloc_bytes"] / 2**20 for s in samples], color="#e3a21a", label="malloc in use")
        ax.axvline(data["warmup_end_s"] / 60, color="gray", linestyle=":", label="end of warm-up")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("minutes")
        ax.set_ylabel("MiB")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{XEON}: 20-minute soaks with every cache at its bound (bench soak --serve)", fontsize=10)
    _save(plt, fig, path)


def plot_transformers_cpu(path: Path) -> None:
    methods = load("bench-code-greedy-k5.json")["methods"]
    order = [("hf-plain", "transformers\ngenerate()", PEER), ("hf-assisted", "transformers\nassisted, K = 5", PEER),
             ("specdecode-plain", "specdecode,\nno draft", OURS_PLAIN), ("specdecode", "specdecode,\nK = 5", OURS)]
    plt, fig, ax = _axes(6.5, 3.4)
    values = [methods[m]["tokens_per_second"] for m, _, _ in order]
    ax.bar(range(4), values, color=[c for _, _, c in order])
    for i, v in enumerate(values):
        ax.text(i, v + 0.15, f"{v:.2f}", ha="center", fontsize=9)
    ax.set_ylim(0, max(values) * 1.15)
    ax.set_xticks(range(4), [label for _, label, _ in order], fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("2-vCPU Intel Xeon (AMX), transformers fp32, code, 128 tokens", fontsize=10)
    _save(plt, fig, path)


def plot_peer_matrix(path: Path) -> None:
    from specdecode.bench.peer_matrix import plot_matrix

    plot_matrix(load(MATRIX_XEON), str(path), XEON + ", llama.cpp 2 threads, Qwen2.5-Coder-1.5B Q4_K_M, 2026-12-03")


def plot_peer_matrix_epyc(path: Path) -> None:
    from specdecode.bench.peer_matrix import plot_matrix

    sources, hardware, _, measured = MATRIX_RUNS[1]
    plot_matrix(load(sources[-1]), str(path), f"{hardware}, llama.cpp 2 threads, Qwen2.5-Coder-1.5B Q4_K_M, {measured}")


FIGURES: dict[str, Callable[[Path], None]] = {
    "results-peer-matrix.png": plot_peer_matrix,
    "results-peer-matrix-epyc.png": plot_peer_matrix_epyc,
    "results-summary.png": plot_summary,
    "results-cpu-tokens.png": plot_cpu_tokens,
    "results-agent.png": plot_agent,
    "results-verify-costs.png": plot_verify_costs,
    "results-prefix-cache.png": plot_prefix_cache,
    "results-batching.png": plot_batching,
    "results-soak-memory.png": plot_soak_memory,
    "results-transformers-cpu.png": plot_transformers_cpu,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the summary table and make no figure")
    parser.add_argument("--undated", action="store_true", help="with --table: the README's table, without dates")
    parser.add_argument("--matrix", metavar="FILE", help="print the table of a matrix run (a file of docs/results/)")
    parser.add_argument("--aider", metavar="FILE", help="print the table of an aider run (a file of docs/results/)")
    parser.add_argument("--corpus", metavar="FILE", help="print the table of a corpus run (a file of docs/results/)")
    parser.add_argument("--out", type=Path, default=IMG, help="the folder the figures go to (default docs/img)")
    parser.add_argument("--only", nargs="*", choices=sorted(FIGURES), help="only these figures")
    args = parser.parse_args()
    if args.table or args.matrix or args.aider or args.corpus:
        print(matrix_table(args.matrix) if args.matrix else aider_table(args.aider) if args.aider
              else corpus_table(args.corpus) if args.corpus else summary_table(dated=not args.undated))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        FIGURES[name](args.out / name)
        print(args.out / name)


if __name__ == "__main__":
    main()
