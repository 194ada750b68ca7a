"""Fault injection for tests: ``SHARDED_EXP_FAULT="rank=1,step=3,kind=raise"``.

A testing aid, documented in the README; never set it in real runs. Kinds:

- ``raise``: the rank raises ``RuntimeError`` at the start of that step.
- ``exit``: the rank's process exits with code 3 at the start of that step.
- ``hang``: the rank stops at the start of that step and never comes back (its peers
  wait in the step's first collective until ``trainer.timeout_s``).
- ``oom``: the rank runs out of memory at the start of that step: a real allocation
  failure on CUDA, ``torch.OutOfMemoryError`` raised on CPU.
- ``exit_in_save``: the rank (rank 0, the writer) exits in the middle of writing the
  checkpoint of that step, after its first file: a kill during a save.
- ``stall``: the rank's device stalls for ``SHARDED_EXP_STALL_S`` seconds (default 60) at
  the start of that step: on CUDA a kernel that sleeps on the compute stream with a
  collective queued behind it, so it times out even at world size 1 (the NCCL hang check
  of ``benchmarks/accuracy/gpu_check.py --hang``); on CPU the process sleeps.
- ``kill``: the rank's process sends itself SIGKILL at the start of that step (as
  ``kill -9`` or the kernel's OOM killer would: no exception, no record).
- ``sigterm``: the rank's process sends itself SIGTERM at the start of that step (a
  signal that reaches one rank only, not the parent).
- ``inf_grad``: the rank's backward writes inf into the gradient of one parameter of its
  own optimizer shard, before any gradient communication, so that (for sharded
  strategies) the inf exists in that rank's shard only.
- ``slow``: from that step on, every forward of the rank's model first sleeps
  ``SHARDED_EXP_SLOW_S`` seconds (default 0.05): a point made slow on purpose, inside the
  timed step (its peers wait for it in the step's collectives), to show a speed
  difference the report must not call noise.
- ``hang_at_exit``: the rank (``step`` is not read) hangs after it finished training and
  sent its payload, where its process group is torn down (as a gloo destructor waiting for
  a thread that waits for the GIL does): the parent kills it ``trainer.stop_grace_s`` later
  and keeps the results; under torchrun or srun the rank exits by itself (code 1, its stacks
  on stderr) that long after (``launch.rank.teardown_deadline``).
- ``tracker_error``: from that step on, torch's MemTracker raises inside its forward
  hooks on that rank (as it does on a model it cannot follow): the CPU peak of that rank
  is then null with the reason, and the run goes on (measuring never breaks training).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

KINDS = (
    "raise",
    "exit",
    "hang",
    "oom",
    "exit_in_save",
    "inf_grad",
    "stall",
    "kill",
    "sigterm",
    "tracker_error",
    "slow",
    "hang_at_exit",
)
SLOW_ENV = "SHARDED_EXP_SLOW_S"
"""``slow``: seconds each forward of the rank's model waits (default 0.05)."""
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
    """The fault to act out, if any; only in a job's first attempt, so that a restart by
    torchrun (``--max-restarts``) can be tested: the restarted ranks run clean."""
    text = os.environ.get(ENV, "").strip()
    fault = parse(text) if text else None
    return fault if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 else None


def hang_at_exit(rank: int) -> None:
    """Act out ``hang_at_exit`` on this rank, if it is the fault: never return."""
    fault = from_env()
    if fault is not None and fault.kind == "hang_at_exit" and fault.rank == rank:
        log.warning("%s: hang_at_exit on rank %d, time %.3f", ENV, rank, time.time())
        while True:  # signals set flags only: this rank ends when it is killed
            time.sleep(3600)


def trigger(fault: Fault, rank: int, device: torch.device) -> None:
    """Act out ``raise``, ``exit``, ``hang`` or ``oom`` at the start of a step
    (``inf_grad`` is the strategy's, ``exit_in_save`` the checkpoint writer's)."""
    if fault.kind in ("exit_in_save", "hang_at_exit"):
        return
    if fault.kind == "tracker_error":
        # lazy: the MemTracker adapter imports torch's private mem_tracker (inductor, about 3 s); only this fault needs it
        from sharded_exp.measure.memtracker import fail_in_hooks

        fail_in_hooks(f"injected tracker failure on rank {rank} at step {fault.step}")  # this rank's process only
        return
    # When it happened, for measuring fault-to-exit times (tests, README figures).
    log.warning("%s: %s on rank %d at step %d, time %.3f", ENV, fault.kind, rank, fault.step, time.time())
    for handler in logging.getLogger().handlers:  # out before the fault takes the process
        handler.flush()
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {fault.step}")
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind in ("kill", "sigterm"):
        os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)
        if fault.kind == "kill":
            time.sleep(60)  # SIGKILL is delivered before this returns
        return
    if fault.kind == "hang":
        while True:  # signals set flags only: this rank ends when it is killed
            time.sleep(3600)
    if fault.kind == "stall":
        seconds = float(os.environ.get("SHARDED_EXP_STALL_S", "60"))
        if device.type == "cuda":
            torch.cuda._sleep(int(seconds * 2e9))  # about 2 GHz: cycles for ``seconds``
            # A collective queued behind the sleep, before any host sync: the watchdog has
            # something to time out even at world size 1 (no peer to wait for otherwise).
            if dist.is_initialized():
                dist.all_reduce(torch.zeros(1, device=device), async_op=True)
        else:
            time.sleep(seconds)
        return
    if fault.kind == "oom":
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=device)  # cannot fit
        raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank} at step {fault.step}")


class Injector:
    """This rank's fault, acted out by the loop's per-step hooks (a no-op without one)."""

    def __init__(self, rank: int, device: torch.device):
        fault = from_env()
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.rank, self.device = rank, device
        self._hook = None

    def before_step(self, step: int, strategy) -> None:
        """At the start of ``step``: raise, exit, hang, run out of memory, or poison a gradient."""
        if self.fault is None or self.fault.step != step:
            return
        if self.fault.kind == "inf_grad":
            self._hook = poison_gradient(strategy)
        elif self.fault.kind == "slow":  # for the rest of the run: not removed after the step
            seconds = float(os.environ.get(SLOW_ENV, "0.05"))
            strategy.module.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
        else:
            trigger(self.fault, self.rank, self.device)

    def after_step(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def poison_gradient(strategy):
    """Fault ``inf_grad``: make one gradient element of this rank's own optimizer shard inf,
    before any communication. Returns a handle with ``remove()``."""
    if not strategy.traits.shards_parameters:
        param = strategy.local_shard()[0]
        return param.register_hook(lambda g: torch.full_like(g, float("inf")))
    # Sharded parameters never see autograd: hook the gathered weight of the first layer
    # during its forward, and poison only the rows of this rank's own dim-0 shard.
    layer = next(m for m in strategy.module.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2)
    # the rows this rank's shard holds: its place in the (last, sharding) mesh dimension
    mesh = layer.weight.device_mesh if isinstance(layer.weight, DTensor) else None
    rank = mesh.get_local_rank(mesh.ndim - 1) if mesh is not None else torch.distributed.get_rank()
    world_size = mesh.size(mesh.ndim - 1) if mesh is not None else torch.distributed.get_world_size()

    def poison(grad):
        chunk = math.ceil(grad.shape[0] / world_size)
        grad = grad.clone()
        grad[rank * chunk : (rank + 1) * chunk] = float("inf")
        return grad

    handles = []

    def pre_forward(mod, args):
        handles.append(mod.weight.register_hook(poison))

    handles.append(layer.register_forward_pre_hook(pre_forward))

    class Handle:
        def remove(self):
            for h in handles:
                h.remove()

    return Handle()


def in_save(rank: int, step: int) -> None:
    """Called by the checkpoint writer between files: acts out ``exit_in_save``."""
    fault = from_env()
    if fault is not None and fault.kind == "exit_in_save" and (fault.rank, fault.step) == (rank, step):
        os._exit(3)
