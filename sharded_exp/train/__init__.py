"""The rank side's work: the training loop, its metrics, and fault injection for tests.

:mod:`.kept_works` holds the gathers whose gloo works this process, not gloo's worker thread,
lets go of (a teardown that never ends otherwise).
"""
