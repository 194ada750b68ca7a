"""sharded_exp.launch.forkserver: what the rank server preloads for a command line (its
calls, real processes, are tests/integration/test_rank_server.py's)."""

from __future__ import annotations

import pytest

from sharded_exp.launch import forkserver


@pytest.mark.parametrize(
    "args, modules",
    [
        (["model=hf_llama"], ["transformers.models.llama.modeling_llama"]),
        (["strategy=zero1"], ["torch.distributed.optim"]),
        (["-m", "strategy=ddp,zero1"], ["torch.distributed.optim"]),
        (["-m", "strategy=glob(*)"], ["torch.distributed.optim"]),
        (["+strategy=zero1"], ["torch.distributed.optim"]),
        (["-m", "experiment=seed_study"], ["torch.distributed.optim"]),
        (["hparams_search=fastest"], ["torch.distributed.optim"]),
        (["strategy=ddp", "model=mlp"], []),
    ],
)
def test_the_server_preloads_what_the_command_line_names(args, modules):
    assert forkserver.extra_preload(args) == modules
