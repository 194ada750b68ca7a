"""Starting and supervising the ranks of one job.

- :mod:`.parent`: the Hydra job's side: pre-flight, spawn, supervise, first failure,
  signals, ``result.json``.
- :mod:`.rank`: a rank's entry: device, process group, the trainer.
- :mod:`.layout`: where ranks come from (spawned here, torchrun, SLURM).
- :mod:`.forkserver`: the process ranks are forked from, started before heavy imports.
- :mod:`.liveness`: on the rank side, stopping together on a signal and naming a rank that hangs.

This package's ``__init__`` imports nothing: the entry point reads :mod:`.layout` before
torch is imported.
"""
