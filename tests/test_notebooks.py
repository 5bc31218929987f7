"""The notebooks are current: their code compiles, their shown outputs come from a GPU run of
the code as it is now, and the code still runs under the simulator printing what it printed
when that was recorded.

A notebook's outputs are from a GPU run (``python3 scripts/run_notebooks.py --gpu --out DIR``
on a GPU machine, copied back), because the timings and the GPU paths are what a reader wants
to see; CI has no GPU, so it cannot re-run them. What CI can check:

* plain pass: every code cell compiles; ``metadata.loomnb.gpu_run.source_sha256`` -- the hash
  of the code cells the GPU run ran -- equals the hash of the code cells now, so code edited
  after the GPU run fails here instead of showing outputs it no longer produces; and
  ``metadata.loomnb.simulator_source_sha256`` likewise for the recorded simulator output;
* simulator pass (``sim``): the code cells run under numba's CUDA simulator (small shapes) and
  print exactly ``metadata.loomnb.simulator_stdout``, recorded by
  ``python3 scripts/run_notebooks.py --simulator --in-place``, so the kernels, the oracle
  checks and the notebook's code keep working and agreeing (``--simulator`` alone runs the
  same comparison and writes nothing).

The join of the cells, the hash and the run itself are ``scripts/run_notebooks.py``'s, imported
here, so the tests check exactly what the script records.
"""

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "run_notebooks.py"
_spec = importlib.util.spec_from_file_location("run_notebooks", _SCRIPT)
rn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rn)

NOTEBOOKS = rn.notebooks()
GPU_RUN = ("re-run `python3 scripts/run_notebooks.py --gpu --out DIR` on a GPU machine and copy "
           "the notebooks from DIR into notebooks/")
SIM_RUN = "refresh it with `python3 scripts/run_notebooks.py --simulator --in-place`"


def loomnb_metadata(nb):
    return nb["metadata"].get("loomnb", {})


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_compile(path):
    for i, cell in enumerate(rn.code_cells(rn.load(path))):
        compile(rn.text(cell["source"]), f"{path.name}[code cell {i}]", "exec")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_are_from_a_gpu_run_of_this_code(path):
    nb = rn.load(path)
    run = loomnb_metadata(nb).get("gpu_run")
    assert run, f"{path.name} has no GPU run recorded (metadata.loomnb.gpu_run): {GPU_RUN}"
    assert run.get("source_sha256") == rn.source_sha256(nb), (
        f"{path.name}: the notebook's code changed after its GPU run ({run.get('date')}, "
        f"{run.get('device')}): {GPU_RUN}")
    shown = "".join(rn.text(o.get("text")) for c in rn.code_cells(nb) for o in c.get("outputs", ()))
    assert rn.SIMULATOR_MODE not in shown, (
        f"{path.name}: its outputs are a simulator run's, not the GPU run's: {GPU_RUN}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_simulator_record_is_of_this_code(path):
    nb = rn.load(path)
    meta = loomnb_metadata(nb)
    assert "simulator_stdout" in meta, f"{path.name} has no simulator output recorded: {SIM_RUN}"
    assert meta.get("simulator_source_sha256") == rn.source_sha256(nb), (
        f"{path.name}: the notebook's code changed after its simulator output was recorded: "
        f"{SIM_RUN}")


@pytest.mark.sim
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_under_the_simulator_as_recorded(path):
    nb = rn.load(path)
    rc, stdout, stderr = rn.run_simulator(nb, path.stem, timeout=900)
    assert rc == 0, f"{path.name} failed under the simulator:\n{stderr[-3000:]}"
    recorded = rn.text(loomnb_metadata(nb).get("simulator_stdout"))
    assert stdout == recorded, (
        f"{path.name} prints other than its recorded simulator output "
        f"(metadata.loomnb.simulator_stdout): if the change is intended, {SIM_RUN}")


def test_simulator_mode_writes_only_when_told(tmp_path, monkeypatch, capsys):
    """``--simulator`` alone compares and writes nothing (a command from the docs never
    rewrites the committed notebooks); ``--in-place`` records into the notebook, ``--out DIR``
    into a copy. The run itself is faked here (the sim pass above runs the real ones)."""
    nb_path = tmp_path / NOTEBOOKS[0].name
    nb_path.write_bytes(NOTEBOOKS[0].read_bytes())
    recorded = rn.text(loomnb_metadata(rn.load(nb_path)).get("simulator_stdout"))
    printed = {"out": recorded}
    monkeypatch.setattr(rn, "run_simulator", lambda nb, name, timeout=None, echo=False:
                        (0, printed["out"], ""))
    original = nb_path.read_bytes()
    assert rn.main(["--simulator", str(nb_path)]) == 0
    assert "equals the recorded one (nothing written)" in capsys.readouterr().out
    printed["out"] = "something else\n"
    assert rn.main(["--simulator", str(nb_path)]) == 1
    assert "record it with --simulator --in-place" in capsys.readouterr().err
    assert nb_path.read_bytes() == original
    out_dir = tmp_path / "out"
    assert rn.main(["--simulator", "--out", str(out_dir), str(nb_path)]) == 0
    assert loomnb_metadata(rn.load(out_dir / nb_path.name))["simulator_stdout"] == ["something else\n"]
    assert nb_path.read_bytes() == original
    assert rn.main(["--simulator", "--in-place", str(nb_path)]) == 0
    assert loomnb_metadata(rn.load(nb_path))["simulator_stdout"] == ["something else\n"]
    with pytest.raises(SystemExit):
        rn.main(["--simulator", "--in-place", "--out", str(out_dir), str(nb_path)])
