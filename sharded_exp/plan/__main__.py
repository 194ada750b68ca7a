"""``python -m sharded_exp.plan``: :func:`sharded_exp.plan.command.main`."""

import sys

from sharded_exp.plan.command import main

if __name__ == "__main__":
    sys.exit(main())
