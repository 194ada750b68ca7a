"""Measurement of a run: what a rank holds (the CUDA allocator, MemTracker on CPU), its memory history and profile, and its FLOPs; prediction is beside it, in :mod:`sharded_exp.predict`."""
