#!/usr/bin/env python3
"""Run the notebooks' code cells and record what they print.

    python3 scripts/run_notebooks.py --simulator [NOTEBOOK ...]             # run, compare
    python3 scripts/run_notebooks.py --simulator --in-place [NOTEBOOK ...]  # record
    python3 scripts/run_notebooks.py --gpu --out DIR [NOTEBOOK ...]

A notebook's code cells run as one script (the cells' sources joined by a blank line, in order)
in a fresh ``python3 -u`` process, with the repository root first on ``PYTHONPATH`` and the
``notebooks/`` directory as the working directory. Without NOTEBOOK arguments every
``notebooks/*.ipynb`` runs.

``--simulator`` runs under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), no GPU needed.
By itself it writes nothing: it shows each notebook's output and says whether it equals the
output recorded in the notebook (exit status 1 if one differs), as
``tests/test_notebooks.py`` checks in CI. With ``--in-place`` (the repository's notebooks) or
``--out DIR`` (copies) it records the run's whole stdout in the notebook's metadata --
``metadata.loomnb.simulator_stdout`` (a list of lines, each with its newline, as nbformat
stores multi-line strings) and ``metadata.loomnb.simulator_source_sha256``
(:func:`source_sha256`) -- without touching the cells' outputs.

``--gpu`` (a CUDA GPU, no simulator) splits stdout per cell -- each cell is followed by a line
printing a unique marker, so output of child processes a cell runs (sharing fd 1) is attributed
to that cell too -- and writes it as the cells' outputs (one stdout stream per cell that printed
anything, execution counts 1, 2, ... on the code cells), with ``metadata.loomnb.gpu_run`` (the
device, the date, the source hash, torch's version). The notebooks go to ``--out DIR`` under
their own names; the repository copies are not touched.

If a notebook's run fails (a cell raises), its traceback is shown, nothing is written for that
notebook, no further notebook runs, and the exit status is 1. Only the standard library is used
(``torch`` is imported by ``--gpu`` to check for a GPU and name it).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
SEPARATOR = "\n\n"  # between two cells' sources in the script that runs them
SIMULATOR_MODE = "mode: CUDA simulator"  # what every notebook's first cell prints without a GPU


# ------------------------------------------------------------------------ notebook files
def notebooks() -> list[Path]:
    """Every notebook of the repository, in name order."""
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def load(path) -> dict:
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if nb.get("nbformat") != 4:
        raise ValueError(f"{Path(path).name}: nbformat {nb.get('nbformat')}, expected 4")
    return nb


def save(nb: dict, path) -> None:
    """As the repository's notebooks are formatted: one-space indent, UTF-8, final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def text(value) -> str:
    """An nbformat multi-line string (a string or a list of lines) as one string."""
    return value if isinstance(value, str) else "".join(value or ())


def lines(s: str) -> list[str]:
    """``s`` as nbformat stores multi-line strings: lines split after each ``\\n`` only."""
    parts = s.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


# ------------------------------------------------------------------------ the script
def script(nb: dict) -> str:
    """The code cells' sources joined as one script: what ``--simulator`` runs."""
    return SEPARATOR.join(text(c["source"]) for c in code_cells(nb))


def source_sha256(nb: dict) -> str:
    """sha256 (hex) of :func:`script`: identifies the code a recorded run ran."""
    return hashlib.sha256(script(nb).encode("utf-8")).hexdigest()


def marked_script(nb: dict, nonce: str) -> str:
    """:func:`script` with, after each cell, a line printing ``\\n`` + :func:`marker` (the
    ``\\n`` ends a cell's unfinished last line; :func:`split_stdout` removes it again)."""
    return SEPARATOR.join(text(c["source"]) + "\nprint(" + repr("\n" + marker(nonce, i))
                          + ", flush=True)" for i, c in enumerate(code_cells(nb), 1))


def marker(nonce: str, i: int) -> str:
    return f"<<<loomnb-cell-end {nonce} {i}>>>"


def split_stdout(stdout: str, nonce: str, n: int) -> list[str]:
    """Per code cell, what it printed (the inverse of :func:`marked_script`'s markers)."""
    out, pos = [], 0
    for i in range(1, n + 1):
        token = "\n" + marker(nonce, i) + "\n"
        end = stdout.find(token, pos)
        if end < 0:
            raise RuntimeError(f"code cell {i}'s end marker is missing from the output")
        out.append(stdout[pos:end])
        pos = end + len(token)
    if stdout[pos:]:  # printed after the last cell (at exit): the last cell's
        out[-1] += stdout[pos:]
    return out


def run(source: str, *, simulator: bool, name: str = "notebook", timeout=None, echo=False):
    """Run ``source`` as a script (module docstring); returns ``(returncode, stdout, stderr)``.
    ``echo``: show stdout on ours line by line as it comes (through ``echo(line)`` if it is a
    function: what to show for a line) and leave stderr on ours (stderr is then "")."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    with tempfile.TemporaryDirectory(prefix="loomnb-nb-") as tmp:
        path = Path(tmp) / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        cmd = [sys.executable, "-u", str(path)]
        if not echo:
            r = subprocess.run(cmd, cwd=NOTEBOOKS_DIR, env=env, capture_output=True,
                               timeout=timeout)
            return (r.returncode, r.stdout.decode("utf-8", "replace"),
                    r.stderr.decode("utf-8", "replace"))
        show = echo if callable(echo) else (lambda line: line)
        chunks, pending = [], b""
        with subprocess.Popen(cmd, cwd=NOTEBOOKS_DIR, env=env, stdout=subprocess.PIPE) as p:
            while chunk := os.read(p.stdout.fileno(), 1 << 16):
                chunks.append(chunk)
                *done, pending = (pending + chunk).split(b"\n")
                sys.stdout.buffer.write(b"".join(show(line + b"\n") for line in done))
                sys.stdout.flush()
        sys.stdout.buffer.write(show(pending) if pending else b"")
        sys.stdout.flush()
        return p.returncode, b"".join(chunks).decode("utf-8", "replace"), ""


def run_simulator(nb: dict, name: str = "notebook", timeout=None, echo=False):
    """The notebook under the simulator: ``(returncode, stdout, stderr)``."""
    return run(script(nb), simulator=True, name=name, timeout=timeout, echo=echo)


# ------------------------------------------------------------------------ the two modes
def record_simulator(path: Path, out: Path) -> bool:
    nb = load(path)
    rc, stdout, stderr = run_simulator(nb, path.stem, echo=True)
    if rc != 0:
        print(f"\n{path.name}: the simulator run failed (exit status {rc}); nothing written",
              file=sys.stderr)
        return False
    meta = nb["metadata"].setdefault("loomnb", {})
    meta["simulator_stdout"] = lines(stdout)
    meta["simulator_source_sha256"] = source_sha256(nb)
    save(nb, out)
    print(f"{path.name}: simulator output recorded in {out}")
    return True


def check_simulator(path: Path) -> str:
    """Run ``path`` under the simulator and compare with its recorded output; writes nothing.
    Returns ``"same"``, ``"differs"`` or ``"failed"`` (a cell raised)."""
    nb = load(path)
    rc, stdout, _ = run_simulator(nb, path.stem, echo=True)
    if rc != 0:
        print(f"\n{path.name}: the simulator run failed (exit status {rc})", file=sys.stderr)
        return "failed"
    meta = nb["metadata"].get("loomnb", {})
    if text(meta.get("simulator_stdout")) != stdout:
        stale = meta.get("simulator_source_sha256") != source_sha256(nb)
        print(f"{path.name}: prints other than its recorded simulator output"
              + (" (its code changed after the recording)" if stale else "")
              + "; record it with --simulator --in-place", file=sys.stderr)
        return "differs"
    print(f"{path.name}: the simulator output equals the recorded one (nothing written)")
    return "same"


def record_gpu(path: Path, out: Path, device: dict) -> bool:
    nb = load(path)
    h = source_sha256(nb)
    if nb["metadata"].get("loomnb", {}).get("simulator_source_sha256") != h:
        print(f"warning: {path.name}: the recorded simulator output is not of this code; also run "
              f"python3 scripts/run_notebooks.py --simulator --in-place", file=sys.stderr)
    nonce = secrets.token_hex(8)
    cells = code_cells(nb)

    def show(line):  # a marker line as a note where the cell ended
        found = line.decode("utf-8", "replace").strip()
        for i in range(1, len(cells) + 1):
            if found == marker(nonce, i):
                return f"--- (end of code cell {i} of {len(cells)})\n".encode()
        return line

    rc, stdout, _ = run(marked_script(nb, nonce), simulator=False, name=path.stem, echo=show)
    if rc != 0:
        done = sum(marker(nonce, i) in stdout for i in range(1, len(cells) + 1))
        print(f"\n{path.name}: code cell {done + 1} of {len(cells)} raised (traceback above); "
              f"nothing written", file=sys.stderr)
        return False
    try:
        per_cell = split_stdout(stdout, nonce, len(cells))
    except RuntimeError as e:  # e.g. a cell called sys.exit(0)
        print(f"\n{path.name}: {e}; nothing written", file=sys.stderr)
        return False
    if any(SIMULATOR_MODE in s for s in per_cell):
        print(f"\n{path.name}: ran under the simulator, not on the GPU (it printed "
              f"{SIMULATOR_MODE!r}); nothing written", file=sys.stderr)
        return False
    for i, (cell, s) in enumerate(zip(cells, per_cell), 1):
        cell["execution_count"] = i
        cell["outputs"] = ([{"name": "stdout", "output_type": "stream", "text": lines(s)}]
                           if s else [])
    nb["metadata"].setdefault("loomnb", {})["gpu_run"] = {
        "device": device["device"], "date": device["date"], "source_sha256": h,
        "torch": device["torch"]}
    save(nb, out)
    print(f"{path.name}: GPU outputs written to {out}")
    return True


def gpu_device() -> dict:
    """The GPU the run uses, or SystemExit where there is none."""
    try:
        import torch
    except ImportError:
        raise SystemExit("--gpu needs torch with CUDA: torch is not installed") from None
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("note: NUMBA_ENABLE_CUDASIM=1 is ignored by --gpu (the notebooks run without it)",
              file=sys.stderr)
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU, and torch.cuda.is_available() is False here; "
                         "run it on a GPU machine (or use --simulator)")
    return {"device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "torch": torch.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--simulator", action="store_true",
                      help="run under numba's CUDA simulator and compare with the recorded "
                           "output (--in-place or --out DIR: record it in the notebooks' "
                           "metadata)")
    mode.add_argument("--gpu", action="store_true",
                      help="run on the GPU and write the notebooks with their outputs to --out")
    p.add_argument("--out", type=Path,
                   help="directory for the updated notebooks (required with --gpu; with "
                        "--simulator: record there)")
    p.add_argument("--in-place", action="store_true",
                   help="with --simulator: record the output in the notebooks themselves "
                        "(without it, and without --out, --simulator only compares)")
    p.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    args = p.parse_args(argv)
    if args.gpu and args.out is None:
        p.error("--gpu needs --out DIR (the repository's notebooks are not overwritten)")
    if args.in_place and (args.gpu or args.out is not None):
        p.error("--in-place goes with --simulator, without --out")
    paths = [n.resolve() for n in args.notebooks] or notebooks()
    missing = [str(n) for n in paths if not n.is_file()]
    if missing:
        p.error(f"no such notebook: {', '.join(missing)}")
    device = gpu_device() if args.gpu else None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    same = True
    for path in paths:
        out = args.out / path.name if args.out else path
        print(f"=== {path.name} ({'GPU: ' + device['device'] if args.gpu else 'simulator'})",
              flush=True)
        if args.gpu:
            ok = record_gpu(path, out, device)
        elif args.out is None and not args.in_place:
            verdict = check_simulator(path)
            ok, same = verdict != "failed", same and verdict == "same"
        else:
            ok = record_simulator(path, out)
        if not ok:
            return 1
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
