"""``python -m sharded_exp.report``: :func:`sharded_exp.report.command.main`."""

import sys

from sharded_exp.report.command import main

if __name__ == "__main__":
    sys.exit(main())
