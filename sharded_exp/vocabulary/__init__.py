"""One vocabulary per concept: what a memory category and a metric are called, in one place.

The modules here import nothing else from sharded_exp, so every part (measuring, predicting,
planning, the report, the loggers) can read them without tying itself to another part.
"""
