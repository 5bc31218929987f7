"""``python -m loomnb``: the ``loomnb`` command line (``python -m loomnb --help``).

The same as the ``loomnb`` console script; see :mod:`loomnb.models.cli`. The decode loop needs
the ``torch`` and ``model`` extras: without them this prints one line saying what to install
and exits 2.
"""

import sys


def main(argv=None, prog="python -m loomnb") -> int:
    """Run the command line; returns the exit code."""
    try:
        from loomnb.models.cli import main as cli_main
    except ImportError as e:  # torch, gguf or tokenizers missing; loomnb's own errors propagate
        if (e.name or "loomnb").split(".")[0] == "loomnb":
            raise
        print(f"{prog}: error: the command line needs {e.name or 'a missing package'}: "
              "python3 -m pip install 'loomnb[torch,model]' (see the README)", file=sys.stderr)
        return 2
    return cli_main(argv, prog=prog)


def console() -> int:
    """The ``loomnb`` console script (named ``loomnb`` in messages)."""
    return main(prog="loomnb")


if __name__ == "__main__":
    sys.exit(main())
