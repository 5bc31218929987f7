"""The notebooks parse and compile (plain pass), and run under the simulator (sim pass) printing
exactly the outputs stored in them, so a notebook's outputs cannot go stale unnoticed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def code_cells(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4, f"{path.name}: nbformat {nb['nbformat']}"
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_compile(path):
    for i, cell in enumerate(code_cells(path)):
        compile("".join(cell["source"]), f"{path.name}[code cell {i}]", "exec")


@pytest.mark.sim
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_outputs_are_current(path, tmp_path):
    cells = code_cells(path)
    script = tmp_path / "nb.py"
    script.write_text("\n\n".join("".join(c["source"]) for c in cells))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(path.parent.parent))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    stored = "".join("".join(o.get("text", "")) for c in cells for o in c["outputs"]
                     if o.get("output_type") == "stream" and o.get("name") == "stdout")
    assert run.stdout == stored, "stored outputs are stale: re-run jupyter nbconvert --execute"
