"""The time model's pure core: how long a training step takes on a GPU you do not have.

- :mod:`~sharded_exp.speed.profiles`: device and link figures, each with its source, read
  from ``profile_data/*.yaml``;
- :mod:`~sharded_exp.speed.collectives`: all-reduce, all-gather, reduce-scatter, broadcast
  and reduce priced by ring and tree as NCCL documents them, flat and two-level groups;
- :mod:`~sharded_exp.speed.compute`: one op's time (roofline or a measured curve), and aten
  ops from a FLOP counter turned into ops;
- :mod:`~sharded_exp.speed.schedule`: each strategy's step as data (compute segments and
  the collectives issued between them), one two-stream simulator, and MFU.

Nothing here runs a model or touches a device: plain numbers in, seconds out.
"""
