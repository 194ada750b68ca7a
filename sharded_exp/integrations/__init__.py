"""sharded_exp's probe in other frameworks' loops: :mod:`.lightning` (a ``Callback``) and
:mod:`.transformers` (a ``TrainerCallback``). Each imports its framework only when imported."""
