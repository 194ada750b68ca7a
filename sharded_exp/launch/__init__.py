"""Starting and supervising the ranks of one job.

- :mod:`.parent`: the Hydra job's side, top to bottom: pre-flight, the ranks, ``result.json``.
- :mod:`.preflight`: every check and decision made once, before any rank; the JobSpec (run in a
  process forked from the rank server when the command started it).
- :mod:`.run_dir`: the run and checkpoint directories held by one live job; earlier attempts moved aside.
- :mod:`.supervise`: spawning and watching the ranks: the first failure, signals passed on, no orphans.
- :mod:`.diagnose`: a failed rank turned into the failure laid over the result.
- :mod:`.rank`: a rank's entry: device, process group, the trainer.
- :mod:`sharded_exp.measure.host_malloc`: a rank's glibc malloc rule: the heap reused (the default), glibc's own, or the mmap threshold fixed (freed large host blocks then go back to the kernel).
- :mod:`.layout`: where ranks come from (spawned here, torchrun, SLURM).
- :mod:`.forkserver`: the process ranks (and the pre-flight check) are forked from, started before heavy imports.
- :mod:`sharded_exp.train.liveness`: on the rank side, stopping together on a signal and naming a
  rank that hangs.

This package's ``__init__`` imports nothing: the entry point reads :mod:`.layout` before
torch is imported.
"""
