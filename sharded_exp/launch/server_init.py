"""Imported first by the rank server (:mod:`.forkserver`), and only there.

A closed terminal sends SIGHUP to the job's whole process group: the parent and the ranks
take it as a request to stop (:data:`.liveness.STOP_SIGNALS`), and the server must outlive
it, as it outlives Ctrl-C's SIGINT (which multiprocessing's server ignores): the parent
learns how its ranks ended through the server, and would otherwise read them as dead.
A rank forked from the server sets its own handler first thing.
"""

import signal

signal.signal(signal.SIGHUP, signal.SIG_IGN)
