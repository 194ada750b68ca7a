"""The probe as a Lightning ``Callback``: your LightningModule and Trainer, unchanged.

    from sharded_exp.integrations.lightning import MemoryProbe

    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[MemoryProbe("outputs/mine/ddp")])

Works with ``lightning.pytorch`` and ``pytorch_lightning`` (whichever is installed, the
former first). Per rank: the peak over a window after warm-up (the CUDA allocator, or the CPU
tracker), its split, the median step time; the strategy as Lightning names it
(``config.framework``) and in sharded_exp's names (``ddp``, ``fsdp``, ...); the fake-step
prediction of the peak from the first batch and your ``training_step`` (its ``self.log`` calls
do nothing while it runs fake). Rank 0 writes ``<run_dir>/result.json`` when training ends.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from sharded_exp.errors import ConfigError
from sharded_exp.precision import Precision
from sharded_exp.probe import Probe
from sharded_exp.probe.fake import loss_of


def _lightning_packages() -> list:
    """Lightning's trainer packages that are installed: ``lightning.pytorch`` (the unified
    package) and ``pytorch_lightning`` (the older name). They are separate class trees: a
    ``pytorch_lightning.Trainer`` refuses a ``lightning.pytorch.Callback``, and both are often
    installed side by side."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    if not found:
        raise ImportError(
            "sharded_exp.integrations.lightning needs lightning or pytorch_lightning (pip install lightning)"
        )
    return found


_PACKAGES = _lightning_packages()
pl = _PACKAGES[0]


def _precision(lightning: str) -> str:
    """sharded_exp's name for Lightning's precision (``16-mixed`` -> ``16``); one it has no
    name for (``64-true``) as Lightning says it."""
    try:
        return Precision.parse(lightning).value
    except ConfigError:
        return str(lightning)


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)


class MemoryProbe(*(package.Callback for package in _PACKAGES)):  # a Callback of each installed tree
    def __init__(
        self,
        run_dir: str | None = None,
        *,
        warmup_steps: int = 5,
        track_steps: int = 2,
        samples_per_step: int | None = None,
        predict: bool = True,
    ):
        self.run_dir, self.predict = run_dir, predict
        self.options = {"warmup_steps": warmup_steps, "track_steps": track_steps}
        self.samples_per_step = samples_per_step
        self.probe: Probe | None = None
        self.result: Any = None  # rank 0: the probe's result (sharded_exp.job.result.Result) once training ended
        self._global_step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.probe is not None:
            return
        strategy = trainer.strategy
        samples = self.samples_per_step or (_batch_size(batch) or 0) * trainer.accumulate_grad_batches or None
        self.probe = Probe(
            strategy.model or pl_module,
            trainer.optimizers[0],
            self.run_dir,
            samples_per_step=samples,
            precision=_precision(trainer.precision),
            framework={
                "name": "lightning",
                "version": pl.__version__,
                "strategy": type(strategy).__name__,
                "precision": str(trainer.precision),
                "devices": trainer.num_devices,
                "num_nodes": trainer.num_nodes,
            },
            source="lightning",
            grad_accum=trainer.accumulate_grad_batches,
            **self.options,
        )
        self._global_step = trainer.global_step
        if self.predict:
            self.probe.predict(
                batch,
                lambda module, b: loss_of(module.training_step(b, batch_idx)),
                trainer.precision_plugin.forward_context(),
                # automatic optimization zeroes the gradients between training_step and backward
                zero_grad_after_forward=pl_module.automatic_optimization,
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.probe is None or trainer.global_step == self._global_step:
            return  # an accumulating micro-batch: the optimizer has not stepped
        self._global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.probe.step(loss if hasattr(loss, "detach") else None)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.probe is not None:
            self.result = self.probe.close()
