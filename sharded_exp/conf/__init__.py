"""The configs, shipped with the package (Hydra reads them as pkg://sharded_exp.conf)."""
