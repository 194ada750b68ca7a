"""``python -m tests.helpers.modules_at_exit OUT MODULE [ARGS ...]``: ``python -m MODULE ARGS``,
run as a user runs it, and at its exit the names of the modules it had imported written to OUT,
one a line. It says what the process that answered imported, apart from any process it started
(``python -m sharded_exp`` starts its rank server first, which imports torch meanwhile; an
``-X importtime`` log would mix the two)."""

import atexit
import runpy
import sys


def _write(path: str) -> None:
    with open(path, "w") as f:
        f.write("\n".join(sorted(sys.modules)))


if __name__ == "__main__":
    out, module = sys.argv[1], sys.argv[2]
    atexit.register(_write, out)  # registered first: run last, after the module's own exit handlers
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
