"""Device and link profiles, as data: one YAML file per GPU (``kind: device``) and per
interconnect (``kind: link``), read by :mod:`sharded_exp.speed.profiles`.

Every figure is ``{value, source}`` and its source names a datasheet, a vendor page or a
published micro-benchmark (title and URL); the loader refuses a file that breaks this.
No figure here is fitted to a training throughput.
"""
