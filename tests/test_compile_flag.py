"""`--compile` on generate and serve: the static backend with torch.compile, every step shape warmed up at load, the
warm-up said on stderr before the wait and what it did after it. The compile itself takes minutes on a CPU
(tests/test_compiled_step.py covers it), so here torch.compile hands back the eager step: the flag's path from the
command line to the backend, the warm-up and the lines are the real ones."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specdecode.backends import static
from specdecode.cli.app import app
from specdecode.errors import OptionError
from specdecode.pairing.pair import ModelOptions, check_options, compile_options


@pytest.fixture
def compiled(monkeypatch):
    """The StaticBackends built with compile=...: their compile mode recorded, their step left eager."""
    built = []

    def eager_step(self):
        built.append(self)
        return self._step

    monkeypatch.setattr(static.StaticBackend, "_compiled_step", eager_step)
    return built


def test_generate_with_compile_warms_the_static_backend_up_at_load_and_says_so(tiny_model_dirs, compiled):
    args = ["generate", "hello", "--target", tiny_model_dirs["target"], "--draft", "none", "-n", "4",
            "--ignore-eos", "--no-stream"]
    plain = CliRunner().invoke(app, args)
    result = CliRunner().invoke(app, args + ["--compile"])
    assert result.exit_code == 0, result.output
    [backend] = compiled
    assert backend.compile_mode == "default" and backend.warm_up_report is not None  # CPU: torch.compile's default
    report = backend.warm_up_report
    assert report.warmed and not report.skipped and backend.warmed == report.warmed
    assert result.stdout == plain.stdout  # the same greedy text
    lines = result.stderr.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("--compile: each model's step shapes"))
    warm = next(i for i, line in enumerate(lines) if line.startswith("target: warm-up: "))
    assert said < warm and f"{len(report.warmed)} step shapes" in lines[warm]


def test_compile_means_the_static_backend_and_refuses_another():
    options = ModelOptions(target="t", draft="none", compile=True)
    from specdecode.pairing.pair import _shared

    shared = _shared(options, rows=4)
    assert shared["backend"] == "static"
    assert shared["backend_options"] == compile_options(4) == {"compile": True,
                                                               "warm_up": {"batches": [1, 4], "log": None}}
    with pytest.raises(OptionError, match="compile runs the static backend's steps through torch.compile"):
        check_options(ModelOptions(target="t", draft="none", compile=True, backend="transformers"))


def test_serve_takes_compile():
    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--compile" in result.output
