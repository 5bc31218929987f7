"""Every operator family has all its faces, each named by the family (``docs/scaffold.md``'s
table), and nothing outside the rule carries a family's name.

A family is a public module of ``loomnb/ops`` (``loomnb.ops.FAMILIES``). For a family ``f``:

* ``loomnb/ops/f.py`` (contracts), ``loomnb/ops/_f_kernels.py`` (kernels), ``loomnb/oracle/f.py``;
* ``tests/test_f_oracle.py``, ``test_f_sim.py``, ``test_f_contract.py``, ``test_f_gpu.py``;
* ``benchmarks/bench_f.py`` and ``benchmarks/test_bench_f.py``;
* one notebook ``notebooks/NN_f.ipynb``.

And the other way round: every ``_<x>_kernels.py`` and oracle module (less the oracle's shared
helpers) is a family's; a test file named after a family is ``test_<family>_<face>.py`` with
a face from :data:`FACES`, and no other test file names a family; every ``bench_*.py`` is a
family's or one of :data:`OTHER_BENCHMARKS`, with its ``test_bench_*.py``; every notebook is
``NN_<family>.ipynb``. A new face or a benchmark of the whole model is added here, with a reason.
"""

import re
from pathlib import Path

import loomnb.ops
import loomnb.oracle

REPO = Path(__file__).resolve().parent.parent
FAMILIES = loomnb.ops.FAMILIES
REQUIRED_TESTS = ("oracle", "sim", "contract", "gpu")
FACES = {  # face -> what the file holds
    "oracle": "the oracle's own checks against independent references (plain pass)",
    "sim": "the kernels against the oracle under the CUDA simulator (the family template)",
    "contract": "the error table: every rejected argument and its message",
    "gpu": "the GPU-only paths (shuffles, hardware conversions, vector loads, peers)",
    "cases": "case builders shared by the family's other test files",
    "registers": "the kernels' register use against the largest block they launch",
    "torch_ops": "the family's torch.compile trace",
}
ORACLE_SHARED = ("fp8", "numerics")  # loomnb/oracle's helpers every family uses
OTHER_BENCHMARKS = {  # bench_<name>.py that measure the whole model or the call path, not a family
    "decode": "the SmolLM2 decode loop's TPOT (and --speculative: with prompt lookup)",
    "overhead": "eager per-call host overhead across the families' ops",
    "vllm_ab": "the model inside vLLM with and without loomnb",
}


def stems(folder, pattern):
    return sorted(p.stem for p in (REPO / folder).glob(pattern))


def names_a_family(stem):
    """The families named in ``stem`` as whole ``_``-separated words (``spec_decode`` too)."""
    words = f"_{stem}_"
    return [f for f in FAMILIES if f"_{f}_" in words]


def test_the_families_are_the_ops_and_the_oracles_modules():
    assert FAMILIES and FAMILIES == loomnb.oracle.FAMILIES
    assert set(loomnb.oracle._SHARED) == set(ORACLE_SHARED)


def test_every_family_has_every_face():
    missing = []
    notebooks = stems("notebooks", "*.ipynb")
    for f in FAMILIES:
        faces = [f"loomnb/ops/{f}.py", f"loomnb/ops/_{f}_kernels.py", f"loomnb/oracle/{f}.py",
                 *(f"tests/test_{f}_{face}.py" for face in REQUIRED_TESTS),
                 f"benchmarks/bench_{f}.py", f"benchmarks/test_bench_{f}.py"]
        missing += [p for p in faces if not (REPO / p).is_file()]
        books = [n for n in notebooks if re.fullmatch(rf"\d\d_{f}", n)]
        if len(books) != 1:
            missing.append(f"notebooks/NN_{f}.ipynb (found {books or 'none'})")
    assert not missing, "faces missing (docs/scaffold.md's table):\n" + "\n".join(missing)


def test_kernel_and_oracle_modules_are_the_families():
    kernels = [s for s in stems("loomnb/ops", "_*_kernels.py")
               if s[1:-len("_kernels")] not in FAMILIES]
    oracles = [s for s in stems("loomnb/oracle", "[!_]*.py")
               if s not in FAMILIES and s not in ORACLE_SHARED]
    assert not kernels and not oracles, (kernels, oracles)


FACE_NAME = re.compile(r"test_(.+?)_(" + "|".join(FACES) + ")")


def wrong_test_files(names):
    """Of ``tests/test_*.py`` stems: those that name a family but are not test_<family>_<face>."""
    wrong = []
    for stem in names:
        named = names_a_family(stem)
        m = FACE_NAME.fullmatch(stem)
        if named and not (m and m.group(1) in FAMILIES and named == [m.group(1)]):
            wrong.append(stem)
    return wrong


def stray_benchmarks(names):
    """Of ``benchmarks/bench_*.py`` stems: those neither a family's nor in OTHER_BENCHMARKS."""
    return [s for s in names if s[len("bench_"):] not in (*FAMILIES, *OTHER_BENCHMARKS)]


def wrong_notebooks(names):
    return [n for n in names if not (re.fullmatch(r"\d\d_\w+", n) and n[3:] in FAMILIES)]


def test_test_files_named_after_a_family_follow_the_rule():
    wrong = wrong_test_files(stems("tests", "test_*.py"))
    assert not wrong, ("test files that name a family must be test_<family>_<face>.py, face "
                       f"one of {sorted(FACES)}: {wrong}")


def test_benchmarks_are_the_families_and_the_named_others():
    stray = stray_benchmarks(stems("benchmarks", "bench_*.py"))
    assert not stray, f"bench_<name>.py that is neither a family nor OTHER_BENCHMARKS: {stray}"
    assert not set(OTHER_BENCHMARKS) & set(FAMILIES)
    benches = {s[len("bench_"):] for s in stems("benchmarks", "bench_*.py")}
    orphans = [s for s in stems("benchmarks", "test_bench_*.py")
               if s[len("test_bench_"):] not in benches]
    assert not orphans, f"test_bench_<name>.py without its bench_<name>.py: {orphans}"


def test_notebooks_are_named_by_family():
    names = stems("notebooks", "*.ipynb")
    wrong = wrong_notebooks(names)
    assert not wrong, f"notebooks not named NN_<family>.ipynb: {wrong}"
    numbers = [n[:2] for n in names]
    assert len(numbers) == len(set(numbers)), f"two notebooks share a number: {numbers}"


def test_the_rule_catches_the_names_before_it():
    """The checks above flag the names the faces had before the rule, and pass today's."""
    old_tests = ["test_oracle_norm", "test_oracle_sampling", "test_spec_decode_scan", "test_norm"]
    assert wrong_test_files(old_tests) == old_tests
    assert not wrong_test_files(["test_norm_oracle", "test_sampling_torch_ops",
                                 "test_spec_decode_gpu", "test_attention_cases", "test_reduce",
                                 "test_speculative_loop"])
    old_benches = ["bench_decode_attention", "bench_spec"]
    assert stray_benchmarks(old_benches) == old_benches
    assert not stray_benchmarks(["bench_attention", "bench_spec_decode", "bench_decode"])
    old_books = ["01_rmsnorm", "02_activation_fp8", "04_paged_decode", "06_speculative_verify"]
    assert wrong_notebooks(old_books) == old_books
    assert not wrong_notebooks(["01_norm", "06_spec_decode"])
