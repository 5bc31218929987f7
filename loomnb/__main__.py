"""``python -m loomnb``: the ``loomnb`` command line (``python -m loomnb --help``).

The same as the ``loomnb`` console script; see :mod:`loomnb.models.cli`. ``--version`` and
``--help`` need neither torch nor numba; the decode loop needs the ``torch`` and ``model``
extras: without them ``generate`` prints one line saying what to install and exits 2.
"""

import sys


def main(argv=None, prog="python -m loomnb") -> int:
    """Run the command line; returns the exit code."""
    from loomnb.models.cli import main as cli_main

    return cli_main(argv, prog=prog)


def console() -> int:
    """The ``loomnb`` console script (named ``loomnb`` in messages)."""
    return main(prog="loomnb")


if __name__ == "__main__":
    sys.exit(main())
