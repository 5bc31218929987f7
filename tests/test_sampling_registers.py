"""Every sampling kernel can launch with the largest block ``launch_config`` gives it: its
registers per thread (``ptxas -v`` on the sm_90 PTX) times those threads must fit an SM's
65,536 registers -- a block that does not fit fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
which the simulator cannot show. The check runs on the PTX ``tests/test_ptx.py`` compiles
(``_sampling_checks``); it needs ``ptxas`` (the CUDA toolkit), and this file reports the skip
when there is none.
"""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from loomnb.ops.sampling import THREADS, TOPK_THREADS

pytestmark = pytest.mark.nosim
PTXAS = shutil.which("ptxas")
REGISTERS_PER_SM = 65536
ISA = "9.0"  # the toolkit's ptxas may predate the PTX ISA numba writes; the kernels use nothing newer


def registers(ptx):
    """Registers per thread ptxas allocates for the kernel in ``ptx`` (sm_90)."""
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {ISA}", ptx, flags=re.M)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        run = subprocess.run([PTXAS, "-arch=sm_90", "-v", str(path), "-o", "/dev/null"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(re.search(r"Used (\d+) registers", run.stderr).group(1))


def check_registers(spec, ptx):
    threads = TOPK_THREADS if getattr(spec, "topk", False) else THREADS
    regs = registers(ptx)
    assert regs * threads <= REGISTERS_PER_SM, f"{spec}: {regs} registers x {threads} threads"


def test_ptxas_is_there_for_the_register_check():
    if PTXAS is None:
        pytest.skip("needs ptxas (CUDA toolkit) on the PATH: tests/test_ptx.py skipped the "
                    "sampling kernels' register check")


def test_register_check_catches_a_block_that_does_not_fit():
    if PTXAS is None:
        pytest.skip("needs ptxas (CUDA toolkit) on the PATH")
    from loomnb._numba_internals import compile_ptx
    from loomnb.ops import _sampling_kernels as K
    spec = K.LogprobSpec("f32", "v1", False, True, "vec")
    ptx = compile_ptx(K.logprob_kernel(spec), K.argtypes(spec))
    assert registers(ptx) * 1024 > REGISTERS_PER_SM, "top-k kernels could not take 1024 threads"
    check_registers(spec, ptx)
