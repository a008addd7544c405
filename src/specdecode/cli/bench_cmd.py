"""`specdecode bench` (and `bench latency`), `specdecode eval multiplication` and `specdecode verify`.

Presentation only: the measurements are in specdecode.bench.runner, the statistics in specdecode.bench.stats, the
evaluations in specdecode.evals. Heavy modules are imported inside the commands, so `specdecode --help` stays fast.
"""

from __future__ import annotations

import json
import math
import sys
from typing import List, Optional

import typer

from .app import app
from .common import CLIError, backend_name, err, load_pair, make_generator, out, progress_bar, user_errors
from .options import ModelOptions, model_options

bench_app = typer.Typer()  # its help is the docstring of bench() below
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(help="Task evaluations of speculative vs plain sampling.", no_args_is_help=True)

from .bench_serve_cmd import bench_serve as _bench_serve  # noqa: E402  (the load generator, its own module)

bench_app.command("serve")(_bench_serve)
app.add_typer(eval_app, name="eval")

METHOD_NAMES = ("specdecode-plain", "specdecode", "hf-plain", "hf-assisted", "llamacpp-plain", "llamacpp-prompt-lookup",
                "llama-speculative")
DEFAULT_METHODS = METHOD_NAMES[:-1]  # llama-speculative joins when --llama-speculative names its binary


# ---------------------------------------------------------------------------------------------- helpers
def _float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{name} must be a number or a comma list of numbers (e.g. 0,0.7), got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise CLIError(f"{name} values must be finite and >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def _clean(obj):
    """JSON-safe: NaN and infinities become null (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _write_json(report: dict, path: Optional[str]) -> None:
    if not path:
        return
    text = json.dumps(_clean(report), indent=2, ensure_ascii=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    err.print(f"wrote {path}", markup=False)


def _quiet(json_path: Optional[str]) -> bool:
    """Loading stays silent when the report goes to stdout and nobody watches stderr."""
    return json_path == "-" and not err.is_terminal


def _rate(x) -> str:
    """A throughput with sensible digits: 1234, 123.4, 12.3, 1.23, 0.273."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def _fmt(x, spec: str = ".2f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def _load_prompt_texts(prompts: str, prompts_file: Optional[str], nb_prompts: Optional[int]) -> tuple[list[str], str]:
    from ..bench.prompts import load_file, load_prompts

    items = load_file(prompts_file) if prompts_file else load_prompts(prompts)
    if nb_prompts is not None:
        if nb_prompts < 1:
            raise CLIError(f"--nb-prompts must be >= 1, got {nb_prompts}")
        items = items[:nb_prompts]
    return [p.text for p in items], (prompts_file or prompts)


# ---------------------------------------------------------------------------------------------- bench
@bench_app.callback(invoke_without_command=True)
@model_options(k_default="auto", k_list=True)
def bench(
    ctx: typer.Context,
    prompts: str = typer.Option("code", "--prompts", help="Prompt set: code, prose, edit (built in), or a file "
                                "(.jsonl of {\"prompt\": ...}, or text: prompts separated by '---' lines, else one "
                                "per line)."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", help="Your own prompt file (overrides "
                                               "--prompts)."),
    nb_prompts: Optional[int] = typer.Option(None, "--nb-prompts", help="Use only the first N prompts of the set."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt (every method "
                                       "makes exactly this many)."),
    runs: int = typer.Option(3, "--runs", help="Timed runs of each method over all prompts (interleaved)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs of each method (first prompt only)."),
    temperature: str = typer.Option("0", "--temperature", help="0 = greedy; a comma list (0,0.7,1) sweeps."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k when sampling (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p when sampling (1.0 = off)."),
    methods: str = typer.Option(",".join(DEFAULT_METHODS), "--methods", help="Comma list among: "
                                + ", ".join(METHOD_NAMES) + " (llama.cpp's need a GGUF target)."),
    seed: int = typer.Option(0, "--seed", help="Base seed of the sampling runs."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap prompts in the tokenizer's chat template (when it "
                              "has one), or feed them raw."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write every raw number to this JSON file ('-' = "
                                            "stdout, instead of the table)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG: tokens/s per method, speedup vs K."),
    sanity: bool = typer.Option(False, "--sanity", help="Draft = target, greedy: acceptance must be 1.0; reports "
                                "the loop's overhead."),
    cost_repeats: int = typer.Option(3, "--cost-repeats", help="Forwards timed per step-cost measurement."),
    batch_size: int = typer.Option(1, "--batch-size", help="Rows per generate() call (consecutive prompts, the set "
                                   "cycled): ours and hf-plain decode them together, llama.cpp's methods one after "
                                   "another; tokens/s is summed over rows."),
    llama_speculative: Optional[str] = typer.Option(None, "--llama-speculative", help="Path of llama.cpp's "
                                                    "llama-speculative (or llama-speculative-simple) binary: runs it "
                                                    "on the same GGUF target and draft, as llama-speculative-dmaxN."),
    llama_draft_max: str = typer.Option("2,3,4,8", "--llama-draft-max", help="llama-speculative's --draft-max "
                                        "values, a comma list (one method each)."),
    peer_models: str = typer.Option("stock", "--peer-models", help="Models transformers' methods run on: stock "
                                    "(plain fp32, as a transformers user loads them) or same (our prepacked target "
                                    "and quantized draft, to compare the decoding loops alone)."),
    opts: ModelOptions = None,
) -> None:
    """Benchmark plain vs speculative decoding, ours and transformers'.

    All methods run in one process, on the same prompts and settings.

    Methods: specdecode-plain (our loop, no draft), specdecode (ours,
    speculative), hf-plain (transformers generate), hf-assisted
    (transformers assisted generation with the same draft object and K;
    with K=auto, transformers' own dynamic setting); on a GGUF target,
    llamacpp-plain (llama-cpp-python's own generation, same file and
    threads), llamacpp-prompt-lookup (its LlamaPromptLookupDecoding) and,
    with --llama-speculative PATH, llama.cpp's llama-speculative binary.
    Runs are interleaved after a warm-up. Reports tokens/s, ms/token,
    speedups, acceptance, the measured cost ratio c and verification cost v,
    and the theoretical speedup next to the measured one (fixed K).

    `specdecode bench latency` measures ms/token of the target alone and
    with the draft.
    """
    if ctx.invoked_subcommand is not None:
        return
    with user_errors():
        import dataclasses

        from ..bench.runner import Bench, BenchSettings, encode_prompts
        from ..sampling import SamplingParams

        temperatures = _float_list(temperature, "--temperature")
        chosen = [m.strip() for m in methods.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in METHOD_NAMES]
        if unknown or not chosen:
            raise CLIError(f"unknown --methods {', '.join(unknown) or '(none)'}: choose among {', '.join(METHOD_NAMES)}")
        if llama_speculative and "llama-speculative" not in chosen and methods == ",".join(DEFAULT_METHODS):
            chosen.append("llama-speculative")
        draft_max = _int_list(llama_draft_max, "--llama-draft-max")
        if sanity:
            if "auto" in opts.k_values:
                raise CLIError("--sanity needs a fixed -k (e.g. -k 3): with the draft as costly as the target, "
                               "-k auto rightly declines to draft, and there would be nothing to check")
            temperatures = [0.0]
            chosen = ["specdecode-plain", "specdecode"]
            opts = dataclasses.replace(opts, draft=None)
        settings = BenchSettings(ks=opts.k_values, temperatures=temperatures, max_new_tokens=max_new_tokens,
                                 runs=runs, warmup=warmup, top_k=top_k, top_p=top_p, methods=tuple(chosen),
                                 seed=seed, method=opts.method, cost_repeats=cost_repeats, batch_size=batch_size,
                                 llama_draft_max=draft_max)
        settings.check()
        for t in temperatures:
            SamplingParams(t, top_k, top_p)
        texts, prompt_name = _load_prompt_texts(prompts, prompts_file, nb_prompts)
        target_model, draft_model = load_pair(opts, quiet=_quiet(json_path))
        target_model, draft_model = _with_rows(target_model, opts, batch_size), _with_rows(draft_model, opts,
                                                                                            batch_size)
        if sanity:
            draft_model = target_model
        if draft_model is None and any(m in ("specdecode", "hf-assisted") for m in chosen):
            err.print("no draft (--draft none): running the plain methods only")
        prompt_ids = encode_prompts(target_model.tokenizer, texts, chat)
        info = {"target": opts.target, "draft": opts.target if sanity else (opts.draft if opts.has_draft else None),
                "prompts": prompt_name, "chat": chat, "dtype": opts.dtype, "device": opts.device,
                "backend": backend_name(target_model), "draft_quantize": None if sanity else opts.draft_quantize,
                "quantize": opts.quantize, "sanity": sanity, "peer_models": peer_models, "threads": opts.threads}
        peer_target, peer_draft = _peer_models(peer_models, opts, chosen, sanity, backend_name(target_model))
        llama = _llama_setup(opts, target_model, draft_model, chosen, llama_speculative, sanity)
        runner = Bench(target_model, draft_model, prompt_ids, settings, info, peer_target, peer_draft, llama)
        for method, why in _skipped(runner, chosen):
            err.print(f"{method} left out: {why}", markup=False)
        try:
            with progress_bar(runner.total_steps(), "bench") as advance:
                report = runner.run(progress=advance)
        finally:
            runner.close()
        if sanity:
            report["sanity"] = _sanity_verdict(report)
        if json_path != "-":
            _print_bench(report)
        _write_json(report, json_path)
        if plot:
            from ..bench.plot import plot_report

            plot_report(report, plot)
            err.print(f"wrote {plot}", markup=False)
        if sanity and not report["sanity"]["pass"]:
            raise typer.Exit(1)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{name} must be an integer or a comma list of integers (e.g. 2,4), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CLIError(f"{name} values must be integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def _with_rows(loaded, opts: ModelOptions, rows: int):
    """A llama.cpp model able to hold `rows` rows at a time: load_pair builds one row, so a larger batch reloads
    it with max_rows = rows (a transformers model takes any batch as it is)."""
    model = getattr(loaded, "model", None)
    if rows <= 1 or getattr(loaded, "backend", None) != "llamacpp" or model.max_rows >= rows:
        return loaded
    from ..models.loading import load_model

    model.close()
    return load_model(loaded.name, backend="llamacpp", threads=opts.threads, progress=False,
                      backend_options={"max_rows": rows})


def _llama_setup(opts: ModelOptions, target_model, draft_model, methods, binary: Optional[str], sanity: bool):
    """The GGUF files and threads llama.cpp's methods run on: ours when they run on llama.cpp, else the GGUF of a
    built-in model or .gguf file (None for anything else: those methods are then left out)."""
    from ..bench.llamacpp_peers import default_threads, gguf_file
    from ..bench.runner import LlamaPeerSetup

    if not any(m.startswith("llama") for m in methods):
        return None

    def gguf(name, loaded):
        if getattr(loaded, "backend", None) == "llamacpp":
            return loaded.path
        path = gguf_file(name, progress=False)
        return str(path) if path is not None else None

    draft = None
    if opts.has_draft and not opts.draft_is_lookup and draft_model is not None and not sanity:
        draft = gguf(opts.draft, draft_model)
    return LlamaPeerSetup(target_gguf=gguf(opts.target, target_model), draft_gguf=draft,
                          threads=opts.threads or default_threads(), speculative_binary=binary)


def _skipped(runner, chosen) -> list[tuple[str, str]]:
    """The asked-for methods the runner cannot run here (other than for want of a draft, said already)."""
    return [(m, why) for m, why in runner.skipped.items() if m in chosen and m not in runner.methods
            and why != "no draft (--draft none)"]


def _peer_models(peer_models: str, opts: ModelOptions, methods, sanity: bool, ours: str):
    """The models transformers' methods run on: ours ("same"), or as a transformers user loads them ("stock":
    plain fp32 weights, no prepacking, no draft quantization). (None, None) means ours. ours: the backend our
    target runs on."""
    if peer_models not in ("stock", "same"):
        raise CLIError(f"--peer-models must be stock or same, got {peer_models!r}")
    wants_hf = any(m.startswith("hf-") for m in methods)
    ours_is_stock = (not opts.prepack and opts.draft_quantize in (None, "none") and opts.quantize in (None, "none")
                     and ours == "transformers")
    if peer_models == "same" or not wants_hf or ours_is_stock:
        return None, None
    from ..models.loading import load_model

    # transformers' methods need transformers models, whatever backend ours run on.
    stock = dict(device=opts.device, dtype=opts.dtype, device_map=opts.device_map,
                 trust_remote_code=opts.trust_remote_code, progress=False, backend="transformers")
    target = load_model(opts.target, **stock)
    draft = None
    if opts.has_draft and not opts.draft_is_lookup and not sanity:
        draft = load_model(opts.draft, **stock)
    return target, draft


def _sanity_verdict(report: dict) -> dict:
    checks = []
    costs = report["costs"]
    for config in report["sweep"]:
        spec = config["methods"].get("specdecode")
        if spec is None:
            continue
        theory = config.get("theory") or {}
        expected = theory.get("expected_speedup_refined")
        measured = theory.get("measured_speedup")
        checks.append({"k": config["k"], "acceptance_rate": spec["acceptance_rate"],
                       "rejected": spec["stats"]["proposed_tokens"] - spec["stats"]["accepted_tokens"],
                       "pass": spec["acceptance_rate"] == 1.0,
                       "measured_speedup": measured, "expected_speedup": expected,
                       "overhead": (1.0 - measured / expected) if measured and expected else None})
    return {"pass": bool(checks) and all(c["pass"] for c in checks), "c": costs.get("c"), "checks": checks,
            "note": "draft = target and greedy: every draft must be accepted. The expected speedup uses the "
                    "measured c (≈ 1) and v; overhead = 1 − measured / expected is the loop's own cost."}


def _print_bench(report: dict) -> None:
    from rich.table import Table

    config = report["config"]
    env = report["environment"]
    out.print(f"[bold]specdecode bench[/]  target [cyan]{config.get('target')}[/]"
              + (f"  draft [cyan]{config.get('draft')}[/]" if config.get("draft") else "")
              + f"  prompts {config.get('prompts')} ({config['num_prompts']})  {config['max_new_tokens']} new tokens"
              f"  {config['runs']} run(s) + {config['warmup']} warm-up  torch {env['torch']}, "
              f"transformers {env['transformers']}, {env['torch_threads']} threads")
    for t in config["temperatures"]:
        configs = [c for c in report["sweep"] if c["temperature"] == t]
        title = "greedy (T=0)" if t == 0 else f"T={t:g}" + (f", top-k {config['top_k']}" if config["top_k"] else "") \
            + (f", top-p {config['top_p']:g}" if config["top_p"] < 1 else "")
        speed = Table(title=f"throughput, {title}", title_justify="left")
        present = {name for c in configs for name in c["methods"]}
        peers = [p for p in ("hf-plain", "llamacpp-plain") if p in present]
        for name in ("method", "K", "tok/s", "mean ± std", "ms/tok", "× ours plain", *[f"× {p}" for p in peers],
                     "× hf-assisted"):
            speed.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
        shown = set()
        for c in configs:
            for name, block in c["methods"].items():
                if block.get("shared_across_k"):
                    if name in shown:
                        continue
                    shown.add(name)
                vs = block.get("speedup_vs", {})
                spec = not block.get("shared_across_k")
                ratio = lambda other: _fmt(vs.get(other), ".2f", "") + ("×" if vs.get(other) else "")  # noqa: E731
                speed.add_row(name, str(c["k"]) if spec else "", _rate(block["tokens_per_second"]),
                              f"{_rate(block['tokens_per_second_mean'])} ± {_rate(block['tokens_per_second_std'])}",
                              _rate(block["ms_per_token"]), ratio("specdecode-plain"), *[ratio(p) for p in peers],
                              ratio("hf-assisted") if spec else "")
                if not block["lengths_match"]:
                    err.print(f"[yellow]warning:[/] {name} made {block['new_tokens_per_prompt']} tokens per prompt, "
                              f"not {config['max_new_tokens']} each")
        out.print(speed, soft_wrap=False)
        rows = [(c, name, c["methods"][name]) for c in configs for name in ("specdecode", "hf-assisted")
                if name in c["methods"]]
        rows += [(c, name, block) for c in configs[:1] for name, block in c["methods"].items()
                 if name.startswith("llama-speculative")]  # independent of our K: once
        if rows:
            spec_table = Table(title=f"speculation, {title}", title_justify="left")
            for name in ("method", "K", "accept", "tok/step", "per-position acceptance", "measured ×",
                         "expected ×", "expected × (v)"):
                spec_table.add_column(name, justify="left" if name in ("method", "per-position acceptance")
                                      else "right", no_wrap=name != "per-position acceptance")
            for c, name, block in rows:
                theory = c.get("theory") or {}
                measured = block["speedup_vs"].get({"specdecode": "specdecode-plain", "hf-assisted": "hf-plain"}.get(
                    name, "llamacpp-plain"))
                pos = " ".join(f"{a:.0%}" for a in block.get("per_position_acceptance", []))
                k = str(c["k"]) + (f" (mean {block['mean_k']:.1f})" if block.get("mean_k") is not None else "")
                if block.get("draft_max") is not None:
                    k = f"≤ {block['draft_max']}"
                spec_table.add_row(name, k, _fmt(block.get("acceptance_rate"), ".1%"),
                                   _fmt(block.get("mean_accepted_length"), ".2f"), pos,
                                   _fmt(measured, ".2f") + "×" if measured else "–",
                                   _fmt(theory.get("expected_speedup"), ".2f") + "×" if name == "specdecode"
                                   and theory else "",
                                   _fmt(theory.get("expected_speedup_refined"), ".2f") + "×" if name == "specdecode"
                                   and theory else "")
            out.print(spec_table, soft_wrap=False)
    costs = report["costs"]
    line = f"step costs (warm cache, {costs['prompt_tokens']}-token prompt): target 1 token " \
           f"{costs['target_step_ms']:.1f} ms"
    if costs.get("draft_step_ms") is not None:
        line += f", draft 1 token {costs['draft_step_ms']:.1f} ms → c = {costs['c']:.3f}"
    line += "; verify cost v(K) = (K+1)-token pass / 1-token pass: " + ", ".join(
        f"v({k})={v:.2f}" for k, v in costs["v"].items())
    out.print(line)
    out.print("accept = accepted / proposed drafts; tok/step = tokens per target verification (hf-assisted: from "
              "forward-call counts). measured × = vs the same library's plain decoding. expected × = "
              "(1−α^(K+1)) / ((1−α)(Kc+1)) (Leviathan et al.), expected × (v) = (1−α^(K+1)) / ((1−α)(Kc+v)), "
              "with α = acceptance of the first draft of a step. Throughput is end to end (prefill included).")
    for rec in report["recommended"]["by_temperature"]:
        if rec["k"] is None:
            continue
        verdict = "" if rec["speculation_pays"] else " — slower than plain decoding here: speculation does not pay"
        out.print(f"[bold]recommended[/] at T={rec['temperature']:g}: K={rec['k']} ({rec['method']}, "
                  f"{_rate(rec['tokens_per_second'])} tok/s, {_fmt(rec['speedup_vs_plain'], '.2f')}× plain){verdict}")
    sanity = report.get("sanity")
    if sanity:
        for c in sanity["checks"]:
            out.print(f"sanity K={c['k']}: acceptance {c['acceptance_rate']:.4f} ({c['rejected']} rejected); "
                      f"speed {_fmt(c['measured_speedup'])}× plain vs {_fmt(c['expected_speedup'])}× expected "
                      f"(overhead {_fmt(c['overhead'], '.1%')})")
        out.print("[bold green]SANITY PASS[/]: draft = target, every draft accepted" if sanity["pass"] else
                  "[bold red]SANITY FAIL[/]: with draft = target and greedy decoding every draft should be accepted; "
                  "rare rejections can come from floating-point near-ties between a 1-token and a (K+1)-token "
                  "forward, many point to a bug")


@bench_app.command("latency")
@model_options(k_default="auto", k_list=True)
def latency(
    prompts: str = typer.Option("code", "--prompts", help="Prompt set or file; its first prompt is used."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Use this text as the prompt instead."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="New tokens per timed decode."),
    runs: int = typer.Option(3, "--runs", help="Timed decodes of each configuration."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    seed: int = typer.Option(0, "--seed"),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the chat template."),
    cost_repeats: int = typer.Option(3, "--cost-repeats", help="Forwards timed per step-cost measurement."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the numbers to this JSON file ('-' = stdout)."),
    opts: ModelOptions = None,
) -> None:
    """ms/token of the target alone and with the draft.

    Forward costs on a warm cache (1-token target and draft steps, (K+1)-token
    verification), then end-to-end decoding of one prompt.
    """
    with user_errors():
        from ..bench.runner import encode_prompts, measure_latency
        from ..sampling import SamplingParams

        ks = opts.k_values
        SamplingParams(temperature, 0, 1.0)
        if max_new_tokens < 1 or runs < 1:
            raise CLIError("--max-new-tokens and --runs must be >= 1")
        texts = [prompt] if prompt else _load_prompt_texts(prompts, None, 1)[0]
        target_model, draft_model = load_pair(opts, quiet=_quiet(json_path))
        [ids] = encode_prompts(target_model.tokenizer, texts[:1], chat)
        units = 1 + len(ks) if draft_model is not None else 1
        with progress_bar(2 + runs * units, "latency") as advance:
            report = measure_latency(target_model, draft_model, ids, ks, max_new_tokens, runs, temperature, seed,
                                     cost_repeats, opts.method, progress=advance)
        report.update(target=opts.target, draft=opts.draft if opts.has_draft else None)
        if json_path != "-":
            _print_latency(report)
        _write_json(report, json_path)


def _print_latency(report: dict) -> None:
    from rich.table import Table

    costs = report["costs"]
    table = Table(title=f"latency: {report['target']}"
                  + (f" + draft {report['draft']}" if report.get("draft") else "")
                  + f", {report['max_new_tokens']} tokens, {report['prompt_tokens']}-token prompt", title_justify="left")
    for name in ("configuration", "ms/token (end to end)", "ms/token (decode)", "forward costs", "acceptance",
                 "tok/step", "speedup"):
        table.add_column(name, justify="left" if name in ("configuration", "forward costs") else "right")
    alone = report["target_alone"]
    table.add_row("target alone", f"{alone['ms_per_token']:.1f} ± {alone['ms_per_token_std']:.1f}",
                  _fmt(alone["decode_ms_per_token"], ".1f"), f"1-token step {alone['step_ms']:.1f} ms", "", "", "1.00×")
    for row in report["with_draft"]:
        table.add_row(f"with draft, K={row['k']}", f"{row['ms_per_token']:.1f} ± {row['ms_per_token_std']:.1f}",
                      _fmt(row["decode_ms_per_token"], ".1f"),
                      _row_costs(row, costs), f"{row['acceptance_rate']:.1%}",
                      f"{row['mean_accepted_length']:.2f}", _fmt(row["speedup"], ".2f") + "×")
    out.print(table, soft_wrap=False)
    if costs.get("c") is not None:
        out.print(f"cost ratio c = draft step / target step = {costs['c']:.3f}")


def _row_costs(row: dict, costs: dict) -> str:
    """The draft step and the (K+1)-token verification of a row; auto has no single K to cost."""
    parts = []
    if row["draft_step_ms"] is not None:
        parts.append(f"draft step {row['draft_step_ms']:.1f} ms")
    if row["verify_ms"] is not None:
        parts.append(f"verify {row['verify_ms']:.1f} ms (v={costs['v'][str(row['k'])]:.2f})")
    if row.get("mean_k") is not None and row["k"] == "auto":
        parts.append(f"mean K {row['mean_k']:.2f}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- eval
@eval_app.callback()
def _eval_group() -> None:
    """Task evaluations of speculative vs plain sampling."""


@eval_app.command("multiplication")
@model_options(k_default="4")
def multiplication(
    nb_prompts: int = typer.Option(100, "--nb-prompts", help="Problems per seed."),
    seed: str = typer.Option("0", "--seed", help="Seed of the problems; a comma list (0,1,2) pools several."),
    temperature: float = typer.Option(0.7, "--temperature", help="Sampling temperature of both runs (0 = greedy)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p (1.0 = off)."),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", "-n", help="Most new tokens per answer (both runs)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per generate() call."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write results to this JSON file ('-' = stdout)."),
    opts: ModelOptions = None,
) -> None:
    """Accuracy on a × b: plain vs speculative sampling, Wilson CIs, z-test.

    a and b are drawn from 1..99; the target answers each prompt by plain and
    by speculative sampling.

    Both runs sample the target's own distribution (speculative decoding is
    lossless), so their accuracies should agree up to sampling noise. The
    answer is the first integer the model writes.
    """
    with user_errors():
        from ..evals.multiplication import evaluate, make_problems
        from ..sampling import SamplingParams

        seeds = _seed_list(seed)
        SamplingParams(temperature, top_k, top_p)
        k = opts.num_speculative_tokens
        if batch_size < 1 or max_new_tokens < 1:
            raise CLIError("--batch-size and --max-new-tokens must be >= 1")
        problems = make_problems(nb_prompts, seeds)
        if not opts.has_draft:
            raise CLIError("eval multiplication compares plain with speculative sampling: give a --draft")
        target_model, draft_model = load_pair(opts, quiet=_quiet(json_path))
        plain = make_generator(target_model, None, k, opts.method)
        spec = make_generator(target_model, draft_model, k, opts.method)
        with progress_bar(2 * len(problems), "eval multiplication") as advance:
            result = evaluate(plain, spec, problems, max_new_tokens, temperature, top_k, top_p, batch_size,
                              seed=seeds[0], progress=advance)
        result.update(target=opts.target, draft=opts.draft, k=k, seeds=seeds, nb_prompts=nb_prompts)
        if json_path != "-":
            _print_multiplication(result)
        _write_json(result, json_path)


def _seed_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--seed must be an integer or a comma list of integers, got {text!r}") from None
    if not values:
        raise CLIError("--seed needs at least one integer")
    return list(dict.fromkeys(values))


def _print_multiplication(result: dict) -> None:
    from rich.table import Table

    s = result["sampling"]
    table = Table(title=f"eval multiplication: {result['n']} problems (seeds {','.join(map(str, result['seeds']))}),"
                  f" T={s['temperature']:g}, {result['max_new_tokens']} new tokens max", title_justify="left")
    for name in ("sampling", "correct", "accuracy", "95% Wilson CI", "unparsed", "tok/s", "acceptance"):
        table.add_column(name, justify="left" if name == "sampling" else "right")
    for name, m in result["methods"].items():
        label = "plain (target alone)" if name == "plain" else f"speculative (K={result['k']})"
        table.add_row(label, f"{m['correct']}/{m['n']}", f"{m['accuracy']:.1%}",
                      f"[{m['ci95'][0]:.1%}, {m['ci95'][1]:.1%}]", str(m["unparsed"]), f"{m['tokens_per_second']:.1f}",
                      _fmt(m["acceptance_rate"], ".1%", ""))
    out.print(table, soft_wrap=False)
    c = result["comparison"]
    verdict = ("[green]consistent[/]: no evidence that the accuracies differ" if c["consistent"] else
               "[bold red]INCONSISTENT[/]: the accuracies differ more than sampling noise explains (p < 0.05)")
    out.print(f"difference (speculative − plain) {c['difference'] * 100:+.1f} points; two-proportion z = {c['z']:.2f},"
              f" p = {c['p_value']:.3f}: {verdict}")


# ---------------------------------------------------------------------------------------------- verify
@app.command("verify")
@model_options(k_default="4")
def verify(
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (0 = greedy: every sample "
                                      "must equal the greedy continuation)."),
    top_k: int = typer.Option(3, "--top-k", help="Top-k (0 = off). A small top-k keeps the joint distribution "
                              "enumerable and the test sharp."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p (1.0 = off)."),
    samples: int = typer.Option(2000, "--samples", "-N", help="Speculative samples per prompt."),
    positions: int = typer.Option(4, "--positions", "-P", help="Tokens per sample whose joint distribution is "
                                  "checked. Steps draft at most P−2 tokens: use P >= K+2 to exercise full steps."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Prompt set (code, prose, edit) or file; "
                                          "default: two short built-in prompts."),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="A prompt text (repeatable)."),
    nb_prompts: int = typer.Option(2, "--nb-prompts", help="Use the first N prompts of --prompts."),
    batch_size: int = typer.Option(100, "--batch-size", help="Copies of the prompt per generate() call."),
    seed: int = typer.Option(0, "--seed", help="Base seed of the sampling."),
    alpha: float = typer.Option(1e-3, "--alpha", help="Overall false-alarm rate for an exact sampler "
                                "(Bonferroni-split over all tests)."),
    max_nodes: int = typer.Option(512, "--max-nodes", help="Most prefixes the target is run on per prompt to "
                                  "compute the exact distribution."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the full report to this JSON file ('-' = "
                                            "stdout)."),
    opts: ModelOptions = None,
) -> None:
    """Check on your pair that speculative sampling is lossless.

    For each prompt, the target's exact distribution of the first P tokens
    (joint and per position, after the same temperature/top-k/top-p) is
    computed by running the target alone on every likely prefix; N
    speculative samples are compared with it by total-variation distance and
    chi-square tests. PASS means no deviation was detected at this sample
    size (the report says which TV distance could have been detected); it
    covers only these prompts and positions. Exit code 1 on FAIL.
    """
    with user_errors():
        from ..bench.prompts import load_prompts
        from ..evals.verify import DEFAULT_PROMPTS, verify_pair
        from ..sampling import SamplingParams

        params = SamplingParams(temperature, top_k, top_p)
        k = opts.num_speculative_tokens
        for name, value, low in (("--samples", samples, 1), ("--positions", positions, 1),
                                 ("--batch-size", batch_size, 1), ("--nb-prompts", nb_prompts, 1),
                                 ("--max-nodes", max_nodes, 1)):
            if value < low:
                raise CLIError(f"{name} must be >= {low}, got {value}")
        if not 0 < alpha < 1:
            raise CLIError(f"--alpha must be in (0, 1), got {alpha}")
        if prompt:
            texts = list(prompt)
        elif prompts:
            texts = [p.text for p in load_prompts(prompts)][:nb_prompts]
        else:
            texts = list(DEFAULT_PROMPTS)[:nb_prompts]
        if not opts.has_draft:
            raise CLIError("verify checks speculative decoding: give a --draft")
        target_model, draft_model = load_pair(opts, quiet=_quiet(json_path))
        gen = make_generator(target_model, draft_model, k, opts.method)
        if gen.tokenizer is None:
            raise CLIError("verify needs the target's tokenizer to encode its prompts")
        prompt_ids = [gen.tokenizer(t)["input_ids"] for t in texts]
        if any(not ids for ids in prompt_ids):
            raise CLIError("a prompt encodes to no tokens")
        with progress_bar(samples * len(prompt_ids), "verify") as advance:
            report = verify_pair(gen, prompt_ids, params, positions, samples, batch_size, seed, alpha, max_nodes,
                                 progress=advance)
        report.update(target=opts.target, draft=opts.draft, method=opts.method, prompt_texts=texts)
        if json_path != "-":
            _print_verify(report, gen.tokenizer)
        _write_json(report, json_path)
        if not report["pass"]:
            raise typer.Exit(1)


def _full_steps(report: dict) -> bool:
    """Whether some step drafted all K tokens (under auto, K is the engine's choice: any step that drafted)."""
    k = report["k"]
    return report["max_drafts_per_step_exercised"] >= (1 if k == "auto" else k)


def _print_verify(report: dict, tokenizer) -> None:
    from rich.markup import escape
    from rich.table import Table

    s = report["sampling"]
    out.print(f"[bold]specdecode verify[/]: {report['target']} with draft {report['draft']}, K={report['k']}, "
              f"{report['method']}; T={s['temperature']:g}, top-k {s['top_k'] or 'off'}, top-p {s['top_p']:g}; "
              f"{report['samples_per_prompt']} samples × {report['positions']} tokens per prompt; "
              f"{report['num_tests']} tests at level {report['level_per_test']:.1e} each (α = {report['alpha']:g}).")
    for r, text in zip(report["prompts"], report["prompt_texts"]):
        short = text if len(text) <= 60 else text[:57] + "..."
        table = Table(title=f"prompt {r['prompt_index'] + 1}: {escape(repr(short))}", title_justify="left")
        for name in ("test", "cells", "TV", "TV bound", "chi²", "dof", "p-value", "result"):
            table.add_column(name, justify="left" if name in ("test", "result") else "right")
        for t in r["tests"]:
            result = "[green]pass[/]" if t["pass"] else "[bold red]FAIL[/] " + escape("; ".join(t["reasons"]))
            table.add_row(t["name"], f"{t['pooled_cells']}/{t['cells']}", f"{t['tv']:.4f}", f"{t['tv_threshold']:.4f}",
                          _fmt(t["chi2"], ".1f", "inf"), str(t["dof"]), f"{t['p_value']:.3g}", result)
        out.print(table, soft_wrap=False)
        prov = ", ".join(f"{k} {v}" for k, v in sorted(r["provenance"].items()))
        out.print(f"  tokens sampled by provenance: {prov}; draft acceptance {r['acceptance_rate']:.1%} "
                  f"({r['accepted_tokens']}/{r['proposed_tokens']}); exact reference from {r['exact_forward_rows']} "
                  f"target rows")
    if not report["speculative_path_exercised"]:
        out.print("[yellow]warning:[/] no draft token was proposed (P too small?): only the target's own sampling "
                  "was checked")
    out.print(f"What this checks: the first {report['positions']} sampled tokens follow the target's exact "
              f"distribution (after the same warping), per position and jointly; steps drafted at most "
              f"{report['max_drafts_per_step_exercised']} token(s) (K={report['k']}, P={report['positions']}"
              f"{'' if _full_steps(report) else '; use P >= K+2 for full steps'}"
              f"). "
              f"A PASS means no deviation larger than about TV {report['prompts'][0]['detectable_tv']:.3f} "
              f"(joint) was detected; it is evidence, not proof, and covers only these prompts and positions.")
    out.print("[bold green]PASS[/]: the speculative samples are consistent with the target's distribution"
              if report["pass"] else
              "[bold red]FAIL[/]: the speculative samples do not follow the target's distribution")
