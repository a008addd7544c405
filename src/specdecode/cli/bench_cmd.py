"""`specdecode bench`: our decoding against its peers, on the same prompts and settings.

Presentation only: the methods, the runner and the report are in specdecode.bench, the peers' model setup in
specdecode.bench.peers, the sanity verdict in specdecode.bench.sanity. Heavy modules are imported inside the
command, so `specdecode --help` stays fast. The group's other commands have a module each: bench latency
(bench_latency_cmd), bench serve (bench_serve_cmd); so do eval (bench_eval_cmd) and verify (bench_verify_cmd).
"""

from __future__ import annotations

from typing import Optional

import typer

from ..backends import huge_pages
from ..bench.methods import DEFAULT_METHODS, METHODS, METHOD_CLASSES, default_methods, plain_of
from ..bench.methods.base import NO_DRAFT, TRANSFORMERS
from ..bench.methods.llamacpp_speculative import LlamaSpeculative
from .app import app
from .applies import refuse_ignored, refuse_sampling_at_greedy
from .bench_latency_cmd import latency
from .bench_output import float_list, fmt, int_list, load_prompt_set, quiet, rate, write_json
from .bench_serve_cmd import bench_serve
from .bench_soak_cmd import bench_soak
from .common import CLIError, backend_name, err, flag, load_pair, out, progress_bar, user_errors
from .options import AUTO_DRAFT, ModelOptions, model_options

bench_app = typer.Typer()  # its help is the docstring of bench() below
app.add_typer(bench_app, name="bench")
bench_app.command("latency")(latency)
bench_app.command("serve")(bench_serve)
bench_app.command("soak")(bench_soak)

from . import bench_eval_cmd, bench_verify_cmd  # noqa: E402,F401  (they register `eval` and `verify` on app)


@bench_app.callback(invoke_without_command=True)
@model_options(k_default="auto", k_list=True, draft_default=AUTO_DRAFT)
def bench(
    ctx: typer.Context,
    prompts: str = typer.Option("code", "--prompts", help="Prompt set: code, prose, edit, json (built in; json: "
                                "requests for JSON, each with its schema), multi-turn (built in: sessions of turns "
                                "replayed in order, greedy, each answer until its end of generation; see below), or "
                                "a file (.jsonl of {\"prompt\": ..., \"schema\": ... (optional)}, a .jsonl of "
                                "sessions {\"turns\": [...]}, or text: prompts separated by '---' lines, else one "
                                "per line)."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", help="Your own prompt file (overrides "
                                               "--prompts)."),
    nb_prompts: Optional[int] = typer.Option(None, "--nb-prompts", help="Use only the first N prompts of the set "
                                             "(multi-turn: the first N sessions; the kinds alternate)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt (every method "
                                       "makes exactly this many; with JSON schemas or multi-turn, at most this "
                                       "many)."),
    runs: int = typer.Option(3, "--runs", help="Timed runs of each method over all prompts (interleaved)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs of each method (first prompt only)."),
    temperature: str = typer.Option("0", "--temperature", help="0 = greedy; a comma list (0,0.7,1) sweeps."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k when sampling (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p when sampling (1.0 = off)."),
    methods: str = typer.Option(",".join(DEFAULT_METHODS), "--methods", help="Comma list among: "
                                + ", ".join(METHODS) + " (llama.cpp's need a GGUF target)."),
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
    With JSON schemas (--prompts json): ours under each prompt's schema
    and llamacpp-json-schema (llama-cpp-python's grammar), with the
    validity of every output; specdecode-unconstrained and
    specdecode-plain-unconstrained (only when named) decode the same
    prompts without their schemas, until the end-of-generation token.
    specdecode-prompt-lookup and specdecode-suffix (only when named, or
    multi-turn) are ours with those drafts whatever --draft is, so one run
    compares --draft (a model, or suffix+MODEL) with both.
    Runs are interleaved after a warm-up. Reports tokens/s, ms/token,
    speedups, acceptance, the measured cost ratio c and verification cost v,
    and the theoretical speedup next to the measured one (fixed K).

    Multi-turn (--prompts multi-turn): sessions that edit a file again and
    again, regenerate an answer, or re-read a tool's output. Each turn's
    prompt holds the earlier turns with ours plain's greedy answers (decoded
    once, before timing), so every method decodes the same prompts, in
    order, through one generator; a suffix draft's history is emptied before
    every run, so it holds only the run's earlier turns and sessions.
    Greedy, --batch-size 1. By default runs ours plain, ours with --draft,
    prompt lookup and suffix, and llama.cpp's plain and prompt lookup;
    reports tok/s per turn with ratios to llamacpp-plain and
    llamacpp-prompt-lookup, and checks every answer against the reference.

    `specdecode bench latency` measures ms/token of the target alone and
    with the draft.
    """
    if ctx.invoked_subcommand is not None:
        return
    with user_errors():
        import dataclasses

        from ..bench import sanity as sanity_check
        from ..bench.peers import llama_setup, stock_models
        from ..bench import sessions as multi_turn
        from ..bench.runner import Bench, BenchSettings
        from ..bench.workload import encode_prompts
        from ..pairing.pair import recorded_cost_prior
        from ..exact.sampling import SamplingParams

        temperatures = float_list(temperature, "--temperature")
        sessions, prompt_name = None, prompts_file or prompts
        if multi_turn.is_sessions(prompt_name):
            sessions, items = multi_turn.load_sessions(prompt_name, nb_prompts), []
        else:
            items, prompt_name = load_prompt_set(prompts, prompts_file, nb_prompts)
        schemas = _schemas(items) if items else None
        chosen = _chosen_methods(methods, llama_speculative, schemas is not None, sessions is not None)
        draft_max = int_list(llama_draft_max, "--llama-draft-max")
        asked = opts  # what the user gave, before --sanity drops the draft
        if sanity:
            if "auto" in opts.k_values:
                raise CLIError("--sanity needs a fixed -k (e.g. -k 3): with the draft as costly as the target, "
                               "-k auto rightly declines to draft, and there would be nothing to check")
            temperatures = [0.0]
            chosen = list(sanity_check.METHODS)
            opts = dataclasses.replace(opts, draft=None)
        settings = BenchSettings(ks=opts.k_values, temperatures=temperatures, max_new_tokens=max_new_tokens,
                                 runs=runs, warmup=warmup, top_k=top_k, top_p=top_p, methods=tuple(chosen),
                                 seed=seed, method=opts.method, cost_repeats=cost_repeats, batch_size=batch_size,
                                 llama_draft_max=draft_max, suffix_history_tokens=opts.suffix_history_tokens)
        settings.check()
        if sessions is not None:
            multi_turn.check_settings(settings)
        for t in temperatures:
            SamplingParams(t, top_k, top_p)
        _refuse_ignored(asked, chosen, peer_models, llama_speculative, sanity)
        refuse_sampling_at_greedy(getattr(asked, "given", ()), {"top_k": top_k, "top_p": top_p, "seed": seed},
                                  temperatures, idle={"seed": 0})
        target_model, draft_model = load_pair(opts, quiet=quiet(json_path), rows=batch_size)
        huge_pages.wait_for(target_model, draft_model)  # time the steady state
        if sanity:
            draft_model = target_model
        turns = _reference_turns(target_model, sessions, max_new_tokens, chat) if sessions is not None else None
        prompt_ids = turns.prompt_ids if turns else encode_prompts(target_model.tokenizer, [p.text for p in items],
                                                                   chat)
        info = {"target": opts.target, "draft": opts.target if sanity else (opts.draft if opts.has_draft else None),
                "prompts": prompt_name, "chat": chat, "dtype": opts.dtype, "device": opts.device,
                "backend": backend_name(target_model), "draft_quantize": None if sanity else opts.draft_quantize,
                "quantize": opts.quantize, "sanity": sanity, "peer_models": peer_models, "threads": opts.threads}
        peer_target, peer_draft = stock_models(peer_models, opts, chosen, sanity, backend_name(target_model))
        llama = llama_setup(opts, target_model, draft_model, chosen, llama_speculative, sanity)
        runner = Bench(target_model, draft_model, prompt_ids, settings, info, peer_target, peer_draft, llama,
                       schemas, turns, cost_prior=None if sanity else recorded_cost_prior(opts, target_model))
        left_out = {m: why for m, why in runner.skipped.items() if m in chosen}
        if NO_DRAFT in left_out.values():
            err.print(f"no draft (--draft none): {', '.join(m for m, why in left_out.items() if why == NO_DRAFT)} "
                      f"left out")
        for method, why in left_out.items():
            if why != NO_DRAFT:
                err.print(f"{method} left out: {why}", markup=False)
        if llama is not None and llama.draft_gguf and "llama-speculative" in runner.methods:
            err.print(f"llama-speculative drafts on {llama.draft_gguf}: {llama.draft_gguf_is}", markup=False,
                      soft_wrap=True)
        try:
            with progress_bar(runner.total_steps(), "bench") as advance:
                report = runner.run(progress=advance)
        finally:
            runner.close()
        if sanity:
            report["sanity"] = sanity_check.sanity_verdict(report)
        if json_path != "-":
            _print_bench(report)
            if report["multi_turn"]:
                _print_turns(report["multi_turn"], report["config"].get("draft"))
        write_json(report, json_path)
        if plot:
            from ..bench.plot import plot_report

            plot_report(report, plot)
            err.print(f"wrote {plot}", markup=False)
        if sanity and not report["sanity"]["pass"]:
            raise typer.Exit(1)


def _refuse_ignored(opts: ModelOptions, chosen: list[str], peer_models: str, llama_speculative: Optional[str],
                    sanity: bool) -> None:
    """bench's flags where they would do nothing (cli/applies.py): ours run -k, --method and the suffix's history
    whatever --draft (specdecode-suffix, multi-turn); transformers' stock peers load their own models."""
    given = getattr(opts, "given", frozenset())
    hf = any(METHOD_CLASSES[m].runs_on == TRANSFORMERS for m in chosen)
    refuse_ignored(opts, free_of_draft=("k", "method", "suffix_history_tokens"),
                   peer_backends=("transformers",) if hf and peer_models == "stock" else ())
    if "peer_models" in given and not hf:
        raise CLIError(f"--peer-models {peer_models} does nothing: no transformers method runs ({', '.join(chosen)}); "
                       f"add hf-plain or hf-assisted to --methods, or leave it out")
    if "llama_draft_max" in given and not llama_speculative:
        raise CLIError("--llama-draft-max does nothing without --llama-speculative PATH (llama.cpp's binary it sets)")
    if sanity and given & {"temperature", "methods"}:
        raise CLIError(f"--sanity runs its own methods, greedy: leave out "
                       f"{' and '.join(flag(n) for n in sorted(given & {'temperature', 'methods'}))}")


def _chosen_methods(methods: str, llama_speculative: Optional[str], structured: bool,
                    multi_turn: bool = False) -> list[str]:
    """The methods of --methods. Left at its default: the default methods that fit the workload (free text, JSON
    schemas, or multi-turn); llama-speculative joins them when its binary is given (not on multi-turn: it does not
    stop at the end of generation)."""
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHOD_CLASSES]
    if unknown or not chosen:
        raise CLIError(f"unknown --methods {', '.join(unknown) or '(none)'}: choose among {', '.join(METHODS)}")
    if methods != ",".join(DEFAULT_METHODS):
        return chosen
    chosen = list(default_methods(structured, multi_turn))
    if llama_speculative and not structured and not multi_turn:
        chosen.append(LlamaSpeculative.name)
    return chosen


def _reference_turns(target_model, sessions, max_new_tokens: int, chat: bool):
    """The multi-turn workload's prompts, built from ours plain's greedy answers (bench/sessions.py)."""
    from ..bench.sessions import build_turns
    from ..engine.generators import AutoregressiveGenerator

    with progress_bar(sum(len(s.turns) for s in sessions), "reference answers") as advance:
        return build_turns(AutoregressiveGenerator(target_model), sessions, max_new_tokens, chat, advance)


def _schemas(items) -> list[dict] | None:
    """Each prompt's JSON schema when every prompt has one, None when none has."""
    schemas = [p.schema for p in items]
    if all(s is None for s in schemas):
        return None
    if any(s is None for s in schemas):
        raise CLIError("some prompts have a \"schema\" and some do not: give every prompt a JSON schema, or none")
    return schemas


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
        peers = [p for p in ("hf-plain", "llamacpp-plain", "llamacpp-json-schema") if p in present]
        structured = config.get("workload") == "json_schema"
        free = structured and any(n.endswith(UNCONSTRAINED) for n in present)  # ours without the schemas ran too
        for name in ("method", "K", "tok/s", "mean ± std", "ms/tok", "× ours plain", *[f"× {p}" for p in peers],
                     "× hf-assisted", *(("× unconstrained", "decode × unconstr.") if free else ()),
                     *(("valid JSON", "forced / drafted / sampled") if structured else ())):
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
                ratio = lambda other: fmt(vs.get(other), ".2f", "") + ("×" if vs.get(other) else "")  # noqa: E731
                speed.add_row(name, str(c["k"]) if spec else "", rate(block["tokens_per_second"]),
                              f"{rate(block['tokens_per_second_mean'])} ± {rate(block['tokens_per_second_std'])}",
                              rate(block["ms_per_token"]), ratio("specdecode-plain"), *[ratio(p) for p in peers],
                              ratio("hf-assisted") if spec else "",
                              *((ratio(name + UNCONSTRAINED), _decode_ratio(block, name + UNCONSTRAINED))
                                if free else ()),
                              *((_validity(block), _sources(block)) if structured else ()))
                if not block["lengths_match"] and config.get("workload") == "multi_turn":
                    err.print(f"[yellow]warning:[/] {name}'s answers differ in length from the reference's (see the "
                              f"same-text check below)")
                elif not block["lengths_match"]:
                    err.print(f"[yellow]warning:[/] {name} made {block['new_tokens_per_prompt']} tokens per prompt, "
                              + (f"some cut at {config['max_new_tokens']}: raise --max-new-tokens" if structured
                                 else f"not {config['max_new_tokens']} each"))
        out.print(speed, soft_wrap=False)
        # the methods that count their drafts: per K, and those independent of our K once
        rows = [(c, name, block) for c in configs for name, block in c["methods"].items()
                if "acceptance_rate" in block and not block.get("shared_across_k")]
        rows += [(c, name, block) for c in configs[:1] for name, block in c["methods"].items()
                 if "acceptance_rate" in block and block.get("shared_across_k")]
        if rows:
            spec_table = Table(title=f"speculation, {title}", title_justify="left")
            for name in ("method", "K", "accept", "tok/step", "per-position acceptance", "measured ×",
                         "expected ×", "expected × (v)"):
                spec_table.add_column(name, justify="left" if name in ("method", "per-position acceptance")
                                      else "right", no_wrap=name != "per-position acceptance")
            for c, name, block in rows:
                measured = block["speedup_vs"].get(plain_of(name))
                pos = " ".join(f"{a:.0%}" for a in block.get("per_position_acceptance", []))
                k = str(c["k"]) + (f" (mean {block['mean_k']:.1f})" if block.get("mean_k") is not None else "")
                if block.get("draft_max") is not None:
                    k = f"≤ {block['draft_max']}"
                spec_table.add_row(name, k, fmt(block.get("acceptance_rate"), ".1%"),
                                   fmt(block.get("mean_accepted_length"), ".2f"), pos,
                                   fmt(measured, ".2f") + "×" if measured else "–",
                                   fmt(block["expected_speedup"], ".2f") + "×" if "expected_speedup" in block else "",
                                   fmt(block["expected_speedup_refined"], ".2f") + "×"
                                   if "expected_speedup_refined" in block else "")
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
              "with α = acceptance of the first draft of a step. Throughput is end to end (prefill included); "
              "decode × unconstr. compares ours with and without the schemas after the prefill.")
    for rec in report["recommended"]["by_temperature"]:
        if rec["k"] is None:
            continue
        verdict = "" if rec["speculation_pays"] else " — slower than plain decoding here: speculation does not pay"
        out.print(f"[bold]recommended[/] at T={rec['temperature']:g}: K={rec['k']} ({rec['method']}, "
                  f"{rate(rec['tokens_per_second'])} tok/s, {fmt(rec['speedup_vs_plain'], '.2f')}× plain){verdict}")
    sanity = report.get("sanity")
    if sanity:
        for c in sanity["checks"]:
            out.print(f"sanity K={c['k']}: acceptance {c['acceptance_rate']:.4f} ({c['rejected']} rejected); "
                      f"speed {fmt(c['measured_speedup'])}× plain vs {fmt(c['expected_speedup'])}× expected "
                      f"(overhead {fmt(c['overhead'], '.1%')})")
        out.print("[bold green]SANITY PASS[/]: draft = target, every draft accepted" if sanity["pass"] else
                  "[bold red]SANITY FAIL[/]: with draft = target and greedy decoding every draft should be accepted; "
                  "rare rejections can come from floating-point near-ties between a 1-token and a (K+1)-token "
                  "forward, many point to a bug")


UNCONSTRAINED = "-unconstrained"  # the suffix of our methods that decode the json prompts without their schemas


def _decode_ratio(block: dict, other: str) -> str:
    """Ours against ours after the prefill (answers with and without a schema differ in length)."""
    value = block.get("decode_speedup_vs", {}).get(other)
    return f"{value:.2f}×" if value else ""


def _validity(block: dict) -> str:
    """Outputs that parse and follow their schema, over every run."""
    v = block["json"]
    return f"{v['valid']}/{v['outputs']} ({fmt(v['validity_rate'], '.0%')})"


def _sources(block: dict) -> str:
    """Where our tokens came from under the schemas (shares of the new tokens); empty for a peer."""
    src = block.get("token_sources")
    if src is None:
        return ""
    total = src["forced"] + src["drafted"] + src["sampled"]
    return " / ".join(f"{src[k] / total:.0%}" if total else "–" for k in ("forced", "drafted", "sampled"))


def _print_turns(turns: dict, draft: Optional[str]) -> None:
    """The multi-turn tables: per turn, every method's tok/s and ratios; per kind and turn, tok/s (× llamacpp-plain);
    then the answers that differ from the reference's."""
    from rich.table import Table

    present = {b["method"] for g in turns["by_turn"] for b in g["methods"].values()}
    peers = [p for p in turns["peers"] if p in present]
    table = Table(title="multi-turn, per turn (greedy; tok/s end to end, prefill included)", title_justify="left")
    for name in ("turn", "method", "tok/s", *[f"× {p}" for p in peers], "accept", "same text"):
        table.add_column(name, justify="left" if name in ("turn", "method") else "right", no_wrap=True)
    for group in turns["by_turn"]:
        for i, (name, block) in enumerate(group["methods"].items()):
            vs = block["speedup_vs"]
            same = block["same_text"]
            table.add_row(f"{group['turn']} ({group['prompts']})" if i == 0 else "", name,
                          rate(block["tokens_per_second"]), *[fmt(vs.get(p), ".2f", "") + ("×" if vs.get(p) else "")
                                                              for p in peers],
                          fmt(block.get("acceptance_rate"), ".0%", ""),
                          f"{same['identical']}/{same['answers']}" if same else "")
        table.add_section()
    out.print(table, soft_wrap=False)
    names = list(turns["by_turn"][0]["methods"]) if turns["by_turn"] else []
    kinds = Table(title="per kind and turn: tok/s (× llamacpp-plain)", title_justify="left")
    for name in ("kind", "turn", *names):
        kinds.add_column(name, justify="left" if name in ("kind", "turn") else "right", no_wrap=True)
    for group in turns["by_kind_turn"]:
        cells = [rate(b["tokens_per_second"]) + (f" ({b['speedup_vs']['llamacpp-plain']:.2f}×)"
                                                  if "llamacpp-plain" in b["speedup_vs"] else "")
                 for b in group["methods"].values()]
        kinds.add_row(group["kind"], str(group["turn"]), *cells)
    out.print(kinds, soft_wrap=False)
    out.print(f"specdecode drafts with --draft {draft}; {turns['reference']}; {turns['history']}."
              if draft else f"{turns['reference']}; {turns['history']}.", markup=False)
    for m in turns["mismatches"][:10]:
        err.print(f"[yellow]warning:[/] {m['method']} differs from the reference on {m['session']} turn {m['turn']} "
                  f"(runs {', '.join(str(r + 1) for r in m['runs'])}) from token {m['first_difference']} "
                  f"({m['tokens']} tokens, reference {m['reference_tokens']})", markup=True)
    if len(turns["mismatches"]) > 10:
        err.print(f"... and {len(turns['mismatches']) - 10} more (--json has them all)")
