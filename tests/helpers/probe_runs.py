"""The probe's examples run with an independent measurement beside them (tests/integration/test_probe.py).

    python tests/helpers/probe_runs.py lightning OUT_JSON -- <examples/lightning_probe.py's arguments>
    torchrun --nproc-per-node=2 tests/helpers/probe_runs.py hf OUT_JSON -- <hf_trainer_probe.py's arguments>
    torchrun --nproc-per-node=2 tests/helpers/probe_runs.py plain OUT_JSON -- --wrap ddp --run-dir DIR

After the probe's memory window (warm-up 5 steps, 2 tracked), each rank measures 2 later steps
with torch's own ``MemTracker`` (not sharded_exp's subclass of it), tracking the same model and
optimizer from the same point, and writes its peak to ``OUT_JSON.<rank>``: the steady step's
peak, which the probe's must match.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FROM, STEPS = 10, 2  # the independent window: steps 11 and 12 (the probe's: 6 and 7)


def _memtracker():
    """torch's own MemTracker, but for one rule it shares with sharded_exp's: a view op whose
    result lives in a storage it does not know (a TensorDataset's row taken inside the window)
    allocates nothing. torch's would count the dataset's whole storage as a new activation."""
    from torch.distributed._tools import mem_tracker

    class Tracker(mem_tracker.MemTracker):
        _view = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            outer, self._view = self._view, bool(getattr(func, "is_view", False))
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._view = outer

        def _track(self, reftype, tensor):
            if self._view and not any(st in self._WINFO for st in mem_tracker.get_untyped_storages(tensor)):
                return
            super()._track(reftype, tensor)

    return Tracker()


def _track_fsdp2_gathered(tracker, model) -> None:
    """FSDP2 gathers a unit's parameters into storages it made at the first step and resizes
    them to nothing and back at every step since: a tracker started later follows such a
    resize only for a storage it knows, so each is made known (empty now, between steps)."""
    from torch.distributed._tools import mem_tracker
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            for tensor in param.all_gather_outputs:
                tracker._update_and_maybe_create_winfos(tensor, mem_tracker._MemRefType.ACT)


class Window:
    """torch's MemTracker (:func:`_memtracker`) over optimizer steps FROM+1 .. FROM+STEPS,
    entered and left at step ends."""

    def __init__(self, out: str):
        self.out, self.tracker, self.peak = out, None, None

    def at_step_end(self, done: int, model, optimizer, rank: int, ddp: bool | None = None) -> None:
        """``ddp``: the model trains under DDP without bucket views (None: read from ``model``;
        the Trainer hands its callbacks the model DDP wraps)."""
        if done == FROM:
            self.tracker = _memtracker()
            self.tracker.track_external(model, optimizer)
            self.tracker.__enter__()
            _track_fsdp2_gathered(self.tracker, model)
        elif self.tracker is not None and done < FROM + STEPS:
            self.tracker.reset_mod_stats()
        elif self.tracker is not None and done == FROM + STEPS:
            self.tracker.__exit__(None, None, None)
            snap = self.tracker.get_tracker_snapshot("peak")
            total = sum(v.get("Total", 0) for v in snap.values()) / 2**20
            # DDP's buckets, allocated before any window, live through every step (the
            # probe adds them from DDP's reducer; this from DDP's rule: every trainable
            # gradient has a place in a bucket, unless the gradients are the buckets)
            if ddp is None:
                ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.gradient_as_bucket_view
            if ddp:
                total += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
            Path(f"{self.out}.{rank}").write_text(json.dumps({"rank": rank, "peak_mib": total}))
            self.tracker = None


def plain(out: str, argv: list[str]) -> None:
    import argparse
    import os

    import torch.distributed as dist

    from examples import plain_loop_probe as ex
    from sharded_exp.probe import probe

    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", default="ddp")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=FROM + STEPS + 2)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = ex.wrap(ex.build_model(), args.wrap, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = ex.batches(dist.get_rank(), 32, device)
    batch = next(data)
    window = Window(out)
    with probe(model, optimizer, args.run_dir, samples_per_step=32, example=batch, step_fn=ex.step_fn) as p:
        for done in range(1, args.steps + 1):
            loss = ex.step_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            p.step(loss)
            window.at_step_end(done, model, optimizer, dist.get_rank())
            batch = next(data)
    dist.destroy_process_group()
    del os


def lightning(out: str, argv: list[str]) -> None:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    from examples import lightning_probe as ex

    window = Window(out)

    class Independent(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window.at_step_end(trainer.global_step, trainer.strategy.model, trainer.optimizers[0], trainer.global_rank)

    ex.main(argv, callbacks=[Independent()])


def hf(out: str, argv: list[str]) -> None:
    from transformers import TrainerCallback

    from examples import hf_trainer_probe as ex

    window = Window(out)

    class Independent(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            ddp = args.world_size > 1 and not args.fsdp and not args.deepspeed  # as the probe reads it
            optimizer = getattr(optimizer, "optimizer", optimizer)
            window.at_step_end(state.global_step, model, optimizer, args.process_index, ddp=ddp)

    ex.main(argv, callbacks=[Independent()])


if __name__ == "__main__":
    face, out, sep, *rest = sys.argv[1:]
    assert sep == "--"
    {"plain": plain, "lightning": lightning, "hf": hf}[face](out, rest)
