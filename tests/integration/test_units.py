"""A model's repeated units, found by structure: the layouts models commonly have, none of
which may be mistaken for this project's own ``sharding_units()`` hook (issue 37, item 2:
``self.blocks = nn.ModuleList(...)`` crashed pre-flight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_exp.models import units


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))  # not units: mixed

    def forward(self, x):
        return x + self.act(self.fc(x))


class Layout(nn.Module):
    def __init__(self, attr: str, kind: type, nested: str | None = None):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        stack = kind(*[Block() for _ in range(3)]) if kind is nn.Sequential else kind([Block() for _ in range(3)])
        if nested:  # nanoGPT: self.transformer = nn.ModuleDict(dict(h=nn.ModuleList(...)))
            setattr(self, nested, nn.ModuleDict({attr: stack}))
        else:
            setattr(self, attr, stack)
        self.head = nn.Linear(8, 4)
        self.stack = stack

    def forward(self, x):
        x = self.embed(x)
        for block in self.stack:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("attr, kind, nested", [
    ("blocks", nn.ModuleList, None), ("blocks", nn.Sequential, None), ("layers", nn.ModuleList, None),
    ("layers", nn.Sequential, None), ("h", nn.ModuleList, "transformer"),
])  # fmt: skip
def test_units_are_found_by_structure(attr, kind, nested):
    model = Layout(attr, kind, nested)
    found = units(model)
    assert len(found) == 3 and all(isinstance(u, Block) for u in found)


def test_a_model_naming_its_units_and_hugging_faces_no_split_modules():
    class Named(Layout):
        def sharding_units(self):
            return [self.embed, self.head]

    named = Named("blocks", nn.ModuleList)
    assert units(named) == [named.embed, named.head]

    class HF(Layout):
        _no_split_modules = ["Block"]

    hf = HF("layers", nn.Sequential)
    assert units(hf) == list(hf.layers)


def test_a_model_with_a_blocks_modulelist_plans_and_shards_its_blocks():
    """Pre-flight's shapes and FSDP's units of a model whose blocks sit in ``self.blocks``."""
    from omegaconf import OmegaConf

    from sharded_exp.config import OptimizerConfig
    from sharded_exp.predict.prediction import model_shapes

    with torch.device("meta"):
        model = Layout("blocks", nn.ModuleList)
    shapes = model_shapes(None, OmegaConf.merge(OmegaConf.structured(OptimizerConfig), {"name": "adam"}), module=model)
    assert len(shapes.blocks) == 3 and shapes.root == sum(
        p.numel() for p in (*model.embed.parameters(), *model.head.parameters())
    )


@pytest.mark.slow  # a 2-rank job
def test_a_model_keeping_its_layers_in_self_blocks_trains_under_fsdp_with_checkpointing(tmp_path):
    """Through pre-flight and the ranks: FSDP wraps each of ``self.blocks`` and activation
    checkpointing (refused for a model without units) wraps them too."""
    from tests.helpers.jobs import launch_job

    result = launch_job(["model=custom", "model._target_=tests.helpers.user_models.build_blocks", "strategy=fsdp",
                         "trainer.activation_checkpointing=full", "trainer.steps=3"], tmp_path)  # fmt: skip
    assert result["status"] == "ok", result["error"]
    assert result["steps_done"] == 3 and result["final_loss"] == result["final_loss"]  # not NaN
