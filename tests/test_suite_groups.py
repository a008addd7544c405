"""The suite's scheduling (conftest.py): with `--dist loadgroup` the tests of one xdist_group run on one worker.
The suite relies on it (a file's module fixtures built once, the real models loaded by one worker, one local Ray
instance), and a pytest that moved the nodeid where pytest-xdist does not write the group (9.2 with xdist 3.8)
silently scheduled every test on its own: this runs a small suite the same way and reads where each test ran."""

from __future__ import annotations

import json
import subprocess
import sys

CONFTEST = '''
import json, os, pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.path.name))

@pytest.fixture(autouse=True)
def _where(request):
    yield
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps([request.node.path.name, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
'''


def test_each_group_runs_on_one_worker(tmp_path):
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / name).write_text("import time\nimport pytest\n\n@pytest.mark.parametrize('i', range(6))\n"
                                     "def test_it(i):\n    time.sleep(0.05)\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    where = tmp_path / "where.jsonl"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadgroup", "-o", "addopts=", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                              "WHERE": str(where)})
    assert result.returncode == 0, result.stdout + result.stderr
    ran = [json.loads(line) for line in where.read_text().splitlines()]
    workers = {name: {worker for n, worker in ran if n == name} for name, _ in ran}
    assert len(ran) == 18 and all(len(w) == 1 for w in workers.values()), workers
    assert len(set().union(*workers.values())) == 2  # and both workers did run tests
