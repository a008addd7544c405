"""The README's set-up and test commands are CI's: .ci/run installs with the same script and runs exactly the
README's test command, and the script builds llama.cpp with the flags of deploy/llama-cpp.env (the one place they are
written), so the README, GETTING_STARTED.md and CI cannot drift apart."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
INSTALL = ROOT / "scripts" / "install.sh"
FLAGS = ROOT / "deploy" / "llama-cpp.env"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def section_blocks(path: Path, heading: str) -> list[str]:
    """The ```bash blocks of a page's section (from its heading to the next heading of the same or a higher level)."""
    text = path.read_text(encoding="utf-8")
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start + len(heading) + 2)
    body = text[start:end.start() if end else len(text)]
    return [code for lang, code in FENCE.findall(body) if lang in ("bash", "sh")]


def command_lines(block: str) -> list[str]:
    """The commands of a shell block, comments dropped and continuations joined, each as its words re-joined."""
    joined = block.replace("\\\n", " ")
    return [shlex.join(argv) for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def ci_lines() -> list[str]:
    return command_lines(CI.read_text(encoding="utf-8"))


def test_ci_runs_the_readmes_commands():
    [setup] = section_blocks(README, "## Set-up")
    [line] = command_lines(setup)  # one command: the install, then the first generation
    install, first = line.split(" '&&' ")
    assert install == "bash scripts/install.sh"
    assert first.startswith("specdecode generate")
    [tests] = section_blocks(README, "## Tests")
    [test_command] = [line for line in tests.splitlines() if line.strip()]
    ci = CI.read_text(encoding="utf-8").rstrip().splitlines()
    assert ci[-1] == test_command, "CI's last line must be exactly the README's test command"
    assert test_command == 'pip install -e ".[ray,test]" && python -m pytest -q'
    installs = [line for line in ci_lines() if line.split()[:2] == ["bash", "scripts/install.sh"]]
    assert len(installs) == 1, "CI installs with the README's script"
    assert "CMAKE_ARGS=" not in CI.read_text(encoding="utf-8"), "the flags live in deploy/llama-cpp.env alone"


def test_getting_started_gives_the_same_commands():
    page = ROOT / "docs" / "GETTING_STARTED.md"
    [install] = section_blocks(page, "## Install")
    [readme_setup] = section_blocks(README, "## Set-up")
    assert command_lines(install) == command_lines(readme_setup)
    [tests] = section_blocks(page, "## Running the tests")
    [readme_tests] = section_blocks(README, "## Tests")
    assert tests == readme_tests


def _printed(env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
    env.update(env_extra or {})
    done = subprocess.run(["bash", str(INSTALL), "--print"], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_install_script_builds_with_the_flags_file():
    [assignment] = [line for line in FLAGS.read_text().splitlines() if line.startswith("LLAMA_CPP_CMAKE_ARGS=")]
    flags = shlex.split(assignment.split("=", 1)[1])[0].replace("${ROOT}", str(ROOT)).split()
    assert "-DCMAKE_C_FLAGS=-U__AMX_INT8__" in flags and "-DLLAVA_BUILD=OFF" in flags
    printed = _printed()
    words = shlex.split(printed)
    assert words[0] == "CMAKE_ARGS=" + " ".join(flags)
    assert words[1:] == ["pip", "install", "-e", ".[models,llamacpp]"]
    include = next(f for f in flags if f.startswith("-DCMAKE_PROJECT_INCLUDE=")).split("=", 1)[1]
    assert Path(include).is_file(), include
    # CMAKE_ARGS of the caller come after the file's (an AVX2-only build, GETTING_STARTED.md)
    extra = _printed({"CMAKE_ARGS": "-DGGML_NATIVE=OFF -DGGML_AVX2=ON"})
    assert shlex.split(extra)[0] == "CMAKE_ARGS=" + " ".join(flags) + " -DGGML_NATIVE=OFF -DGGML_AVX2=ON"
