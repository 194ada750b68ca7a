"""``python -m sharded_exp.checkpoint export SRC DST``."""

import sys

from sharded_exp.checkpoint.export import main

sys.exit(main())
