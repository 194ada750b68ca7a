"""Imported first by the rank server (:mod:`.forkserver`), and only there.

A closed terminal sends SIGHUP to the job's whole process group, and so do ``kill -TERM
-PGID``, systemd's stop, SLURM's ``scancel`` and ``timeout`` with SIGTERM: the parent and the
ranks take either as a request to stop (:data:`.liveness.STOP_SIGNALS`), and the server must
outlive it, as it outlives Ctrl-C's SIGINT (which multiprocessing's server ignores): the
parent learns how its ranks ended through the server, and would otherwise read them as dead
(exit code 255) while they still finish their step, save and report, and end the job without
their figures or their last checkpoint. A rank forked from the server sets its own handlers
first thing; the server ends with the job (:func:`.forkserver.stop`, or its parent's pipe closing).
"""

import signal

signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
