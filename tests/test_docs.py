"""The documentation describes this repository and nothing outside it, and says what the code does.

* no file points outside the repository (a clone has nothing beside it);
* every repository path the README, ``docs/`` and the notebooks cite exists, and every raw log
  they cite (``in `gpu_logs_<run>.tar.xz`: `NAME` ``) is in that archive, as is every log a run
  folder's README names;
* ``docs/numerics.md`` has the shared rules and the RMSNorm section written;
* the README's CPU example runs and prints one answer, and the README says how to choose
  torch's CPU or CUDA build;
* the FP8 ops' docstrings say ``out`` may be ``uint8`` codes, and the ops accept it (sim pass).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml"}
# Spelled in pieces so that this file does not match itself.
OUTSIDE = ["../" + "shared", "shared folder " + "beside", "beside the " + "repository"]


def repository_text_files():
    roots = [REPO / d for d in ("loomnb", "tests", "benchmarks", "notebooks", "docs", "scripts",
                                ".ci")]
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    for root in roots:
        if root.is_dir():
            files += [p for p in root.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES
                                                                      or p.parent.name == ".ci")]
    return [p for p in files if "__pycache__" not in p.parts and p.exists()]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in repository_text_files():
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if any(pattern in line for pattern in OUTSIDE):
                hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()[:120]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


CITED = re.compile(r"(?<![\w/.])((?:loomnb|tests|benchmarks|docs|notebooks|scripts)/"
                   r"[\w./-]*\w\.(?:py|md|ipynb|sh|json|csv|log|txt|png|tar\.xz))")


def user_docs():
    """(name, text) of the README, docs/*.md and every notebook cell."""
    docs = [("README.md", (REPO / "README.md").read_text())]
    docs += [(str(p.relative_to(REPO)), p.read_text()) for p in sorted((REPO / "docs").glob("*.md"))]
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        docs.append((str(nb.relative_to(REPO)), "\n".join("".join(c["source"]) for c in cells)))
    return docs


def test_cited_repository_paths_exist():
    missing = [f"{name}: {m}" for name, text in user_docs() for m in CITED.findall(text)
               if not (REPO / m).exists()]
    assert not missing, "documents cite files that do not exist:\n" + "\n".join(missing)


def test_the_citation_check_finds_paths():
    """The regex above must see the paths the notebook and README cite (or the check is empty)."""
    cited = {m for _, text in user_docs() for m in CITED.findall(text)}
    assert {"tests/test_norm_gpu.py", "benchmarks/bench_norm.py", "docs/numerics.md"} <= cited


RESULTS = REPO / "benchmarks" / "results"
# a log kept in one of benchmarks/results' archives, cited as: in `gpu_logs_<run>.tar.xz`: `NAME`
IN_ARCHIVE = re.compile(r"in `(?:benchmarks/results/)?((?:gpu_)?logs_\w+\.tar\.xz)`: `([^`]+)`")


def archive_names(archive):
    """The file names in one of benchmarks/results' log archives (none if it does not exist)."""
    import tarfile

    path = RESULTS / archive
    if not path.is_file():
        return []
    with tarfile.open(path) as t:
        return [Path(m.name).name for m in t.getmembers() if m.isfile()]


def test_cited_logs_are_in_their_archives():
    """The raw GPU logs live in one archive per run (``benchmarks/results/README.md``): each one
    the docs cite is in the archive they name (NAME may be a glob), and every ``*.log`` /
    ``*.txt`` a run folder's README names is in that run's archive."""
    import fnmatch

    docs = user_docs() + [(p, (REPO / p).read_text()) for p in
                          ("benchmarks/README.md", "benchmarks/results/README.md")]
    cited = [(name, a, m) for name, text in docs
             for a, m in IN_ARCHIVE.findall(" ".join(text.split()))]
    assert len(cited) >= 10, cited
    wrong = [f"{name}: {m} in {a}" for name, a, m in cited
             if not fnmatch.filter(archive_names(a), m)]
    for readme in sorted(RESULTS.glob("gpu_logs_*/README.md")):
        archive = readme.parent.name + ".tar.xz"
        assert (RESULTS / archive).is_file(), f"{readme.relative_to(REPO)}: no {archive} beside it"
        names = archive_names(archive)
        wrong += [f"{readme.relative_to(REPO)}: {m} in {archive}"
                  for m in set(re.findall(r"`([\w*]+\.(?:log|txt))`", readme.read_text()))
                  if not fnmatch.filter(names, m)]
    assert not wrong, "logs cited but not in their archive:\n" + "\n".join(sorted(wrong))
    loose = [str(p.relative_to(REPO)) for p in RESULTS.rglob("*") if p.suffix in (".log", ".txt")]
    tracked = subprocess.run(["git", "ls-files", "--", *loose], cwd=REPO, capture_output=True,
                             text=True).stdout.split() if loose and (REPO / ".git").exists() else []
    assert not tracked, f"raw logs tracked outside the archives: {tracked}"


def numerics_section(title):
    text = (REPO / "docs" / "numerics.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_numerics_shared_rules_and_rmsnorm_are_written():
    shared = numerics_section("Shared rules")
    norm = numerics_section("RMSNorm family")
    for section in (shared, norm):
        assert "<!--" not in section and len(section) > 2000
    for fact in ("0x7FFF", "+448", "0x80", "stored = real / scale", "Model Runner V2", "eps"):
        assert fact in shared, fact
    for fact in ('rounding="once"', "vLLM 0.24.0", "FlashInfer", "float64", "scale_ub",
                 "torch.ops._C.rms_norm", "uint8", "LlamaRMSNorm", "forward_native"):
        assert fact in norm, fact


def readme_cpu_example():
    readme = (REPO / "README.md").read_text()
    m = re.search(r'NUMBA_ENABLE_CUDASIM=1 python3 -c "\n(.*?)"\n```', readme, re.S)
    assert m, "the README's simulator example is gone"
    return m.group(1)


def test_readme_cpu_example_prints_one_answer():
    code = readme_cpu_example()
    assert "np.array_equal" in code
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "True\n", run.stdout


def test_readme_says_how_to_choose_the_torch_build():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu" in readme
    assert "From plain PyPI that is the CUDA build on Linux" in readme


# op -> the docstring that documents its ``out`` (the fused form refers to the static one's)
FP8_OUT_DOC = {"rms_norm_static_fp8_quant": "rms_norm_static_fp8_quant",
               "fused_add_rms_norm_static_fp8_quant": "rms_norm_static_fp8_quant",
               "rms_norm_dynamic_per_token_quant": "rms_norm_dynamic_per_token_quant"}


@pytest.mark.sim
@pytest.mark.parametrize("name", sorted(FP8_OUT_DOC))
def test_fp8_out_may_be_uint8_codes_as_documented(name):
    """The docstrings say ``out`` may be ``uint8`` (the E4M3 codes): the ops accept it, write the
    oracle's codes into it and return it."""
    import ml_dtypes

    import loomnb

    doc = " ".join(getattr(loomnb, FP8_OUT_DOC[name]).__doc__.split())
    assert re.search(r"out: optional .*``uint8``", doc), doc
    if name != FP8_OUT_DOC[name]:
        assert f":func:`{FP8_OUT_DOC[name]}`" in getattr(loomnb, name).__doc__
    rng = np.random.default_rng(5)
    bf16 = ml_dtypes.bfloat16
    x = (rng.standard_normal((3, 24)) * 2).astype(bf16)
    w = rng.standard_normal(24).astype(bf16)
    residual = rng.standard_normal((3, 24)).astype(bf16)
    scale = np.array([0.02], np.float32)
    args = {"rms_norm_static_fp8_quant": lambda: (x, w, scale, 1e-6),
            "fused_add_rms_norm_static_fp8_quant": lambda: (x, residual.copy(), w, scale, 1e-6),
            "rms_norm_dynamic_per_token_quant": lambda: (x, w, 1e-6)}[name]
    codes = np.full(x.shape, 0xAA, np.uint8)
    got = getattr(loomnb, name)(*args(), out=codes)
    want = getattr(loomnb.oracle, name)(*args())
    if name != "rms_norm_static_fp8_quant":  # (out, residual) / (out, scales)
        got, want = got[0], want[0]
    assert got is codes
    assert np.array_equal(codes, np.asarray(want).view(np.uint8))


# docs/scaffold.md's signature rule, checked on every op's signature
OUTPUTS = {"out", "out_q", "out_s", "scales", "lse", "query_out", "key_out", "indices",
           "logprobs", "ranks", "output_token_ids", "num_emitted", "emitted_token_ids",
           "cu_num_emitted"}
OWN_OPTIONS = {"rounding", "check_indices", "check_scale", "fma", "numerics", "return_lse"}
ACTIVATION_OUTPUTS = ("out", "out_q", "out_s")


def test_every_op_follows_the_documented_signature_rule():
    import inspect

    import loomnb

    rule = " ".join((REPO / "docs" / "scaffold.md").read_text().split())
    assert "`silu_and_mul(x, out=None)`" in rule and "`static_scaled_fp8_quant(x, scale, out=None)`" in rule
    assert "the sampling ops' `sampler`" in rule and "keyword-only" in rule
    kw, pos = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    broken = []
    for name in loomnb.ops.OPS:
        op = getattr(loomnb, name)
        params = list(inspect.signature(op).parameters.values())
        activation = op.__module__ == "loomnb.ops.activation"
        if params[-1].name != "stream" or params[-1].kind != kw:
            broken.append(f"{name}: stream= is not the last, keyword-only parameter")
        if params[0].name == "out":
            broken.append(f"{name}: result-first out")
        positional = [p.name for p in params if p.kind == pos]
        for p in params:
            if p.name in OWN_OPTIONS and p.kind != kw:
                broken.append(f"{name}: loomnb's option {p.name} is not keyword-only")
            if p.name in OUTPUTS and p.kind != kw and not (activation and p.name in ACTIVATION_OUTPUTS):
                broken.append(f"{name}: output {p.name} is not keyword-only")
        if activation:  # the outputs, where positional, come last
            outs = [n for n in positional if n in ACTIVATION_OUTPUTS]
            if outs and positional[-len(outs):] != outs:
                broken.append(f"{name}: {outs} are not the last positional parameters")
    assert not broken, "\n".join(broken)


def test_benchmarks_readme_covers_every_script_and_calls_the_ops_as_they_are():
    """benchmarks/README.md names every script of benchmarks/, its loomnb calls bind to the
    ops' signatures (inputs first, outputs keyword-only), and it states no case count that
    would go stale."""
    import inspect

    import loomnb

    text = (REPO / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in sorted((REPO / "benchmarks").glob("*.py")) if p.name not in text]
    assert not missing, f"benchmarks/README.md does not mention {missing}"
    calls = re.findall(r"`loomnb\.(\w+)\(([^)`]*)\)`", text)
    assert {name for name, _ in calls} >= {"rms_norm", "rms_norm_static_fp8_quant"}, calls
    for name, args in calls:
        parts = [a.strip() for a in args.split(",") if a.strip()]
        pos = [a for a in parts if "=" not in a]
        kw = {a.split("=")[0]: None for a in parts if "=" in a}
        inspect.signature(getattr(loomnb, name)).bind(*pos, **kw)  # TypeError if misdocumented
    assert not re.search(r"\(\d+: op × provider", text), "a pytest case count goes stale"
    assert "summarize.py --dry-run" in text and "<tmp>/loomnb-dry-run" in text


# how the project was built is not the reader's business (docs/numerics.md included: it is a
# user doc too)
BUILD_HISTORY = re.compile(r"\bsessions? \d|this session|the session's|the issue\b|issue's|"
                           r"the task's|work rounds?|round (?:one|two|\d)", re.I)


def test_user_docs_speak_to_a_user():
    docs = {p: (REPO / p).read_text() for p in ("README.md", "docs/vllm.md", "docs/scaffold.md",
                                                "benchmarks/README.md")}
    hits = [f"{p}:{i}: {line.strip()[:100]}" for p, text in docs.items()
            for i, line in enumerate(text.splitlines(), 1) if BUILD_HISTORY.search(line)]
    assert not hits, "\n".join(hits)


def test_readme_says_how_long_the_two_commands_take_and_how_to_run_the_notebooks():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "about 2 minutes, most of it downloads" in readme
    assert "about 45-60 minutes for both passes" in readme
    assert "python3 scripts/run_notebooks.py --simulator" in readme and "writes nothing" in readme
    assert "--threads N" in readme and "$OMP_NUM_THREADS" in readme
    assert "--ignore-eos" in readme


def test_install_comments_agree_with_the_readme():
    """pyproject.toml and scripts/test describe the torch extra as the README does (the build
    pip finds first), not as a CPU build."""
    for path in ("pyproject.toml", "scripts/test"):
        text = (REPO / path).read_text()
        assert "pinned CPU build" not in text and "pinned to the CPU build" not in text, path
        assert "whichever build pip finds first" in " ".join(text.split()), path
