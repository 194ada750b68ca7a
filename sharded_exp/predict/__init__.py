"""Prediction of memory, before a run: the model states by formula (:mod:`.memory_model`),
every rank's peak from a training step on fake tensors (:mod:`.fake_step`), and the job's
prediction that pre-flight makes and result.json sets beside the measurement
(:mod:`.prediction`). Measurement is beside it, in :mod:`sharded_exp.measure`."""
