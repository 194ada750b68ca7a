"""sharded_exp: how much memory and speed does each way of sharding data-parallel training buy?"""

__version__ = "0.1.0"
