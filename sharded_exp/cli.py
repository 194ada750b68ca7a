"""The console scripts: ``sharded-exp``, ``sharded-exp-plan``, ``sharded-exp-report``, ``sharded-exp-docs``.

Each is the same program as its ``python -m`` form. This module imports only the standard
library: ``sharded-exp`` starts the rank server before anything heavy is imported (as
``python -m sharded_exp`` does), and Hydra's questions (``--help``, ``--cfg job``,
``-sc query=bash``) start no ranks at all.
"""

from __future__ import annotations

import sys
import time

from sharded_exp.questions import is_query, start_rank_server


def train() -> None:
    """``sharded-exp``: ``python -m sharded_exp``."""
    started = time.time()
    start_rank_server(sys.argv[1:])  # first: its imports are the longest path to the first step
    if not is_query(sys.argv[1:]):  # a typo is refused in a second, before torch (Hydra answers a question itself)
        from sharded_exp.spelling import refuse_misspelled  # lazy: hydra, for this command only

        refuse_misspelled(sys.argv[1:], "config")
    from sharded_exp import __main__ as job  # lazy: after the rank server starts, before anything heavy

    job.run(started=started)


def plan() -> int:
    """``sharded-exp-plan``: ``python -m sharded_exp.plan``."""
    from sharded_exp.plan.command import main  # lazy: each console script imports only its own command

    return main()


def report() -> int:
    """``sharded-exp-report``: ``python -m sharded_exp.report``."""
    from sharded_exp.report.command import main  # lazy: (as above)

    return main()


def docs() -> int:
    """``sharded-exp-docs``: ``python -m sharded_exp.pages``."""
    from sharded_exp.pages import main  # lazy: (as above)

    return main()
