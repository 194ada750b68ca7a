"""Fault injection for tests: ``SHARDED_EXP_FAULT="rank=1,step=3,kind=raise"``.

A testing aid, documented in the README; never set it in real runs. Kinds:

- ``raise``: the rank raises ``RuntimeError`` at the start of that step.
- ``exit``: the rank's process exits with code 3 at the start of that step.
- ``inf_grad``: the rank's backward writes inf into the gradient of one parameter of its
  own optimizer shard, before any gradient communication, so that (for sharded
  strategies) the inf exists in that rank's shard only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("raise", "exit", "inf_grad")
ENV = "SHARDED_EXP_FAULT"


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str


def parse(text: str) -> Fault:
    try:
        fields = dict(item.split("=", 1) for item in text.split(","))
        fault = Fault(rank=int(fields["rank"]), step=int(fields["step"]), kind=fields["kind"])
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{ENV}={text!r} is not of the form rank=R,step=S,kind=K ({exc})") from None
    if fault.kind not in KINDS:
        raise ValueError(f"{ENV} kind={fault.kind!r} is not one of {', '.join(KINDS)}")
    return fault


def from_env() -> Fault | None:
    text = os.environ.get(ENV, "").strip()
    return parse(text) if text else None
