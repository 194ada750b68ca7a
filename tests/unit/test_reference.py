"""reference.py: the config reference page says each declared bound beside its field."""

from __future__ import annotations

import dataclasses

from sharded_exp.config import bounded
from sharded_exp.reference import allowed


@dataclasses.dataclass
class Part:
    width: int = bounded(128, multiple_of="heads")
    rate: float = bounded(0.5, at_least=0, at_most=1)
    plain: int = 3
    groups: int = bounded(1, divides_world_size="groups of equal size")


def test_each_declared_bound_is_said_and_a_plain_field_says_nothing():
    fields = {f.name: f for f in dataclasses.fields(Part)}
    assert allowed(fields["width"], "model") == " Allowed: a multiple of `model.heads`."
    assert allowed(fields["rate"], "data") == " Allowed: >= 0, <= 1."
    assert allowed(fields["plain"], "data") == ""
    assert (
        allowed(fields["groups"], "strategy") == " Allowed: a divisor of `trainer.world_size` (groups of equal size)."
    )
