"""Bytes each strategy's collectives move per step, measured with the torch profiler.

    python -m benchmarks.features.communication                     # GPT, fp32, 2 ranks, every strategy
    python -m benchmarks.features.communication --world-size 4 --strategies ddp fsdp
    python -m benchmarks.features.communication --smoke             # CI: one strategy, one step

Each rank builds the strategy through the registry, runs warm-up steps with the
trainer's own ``train_step``, then records a few steps under ``torch.profiler`` with
shapes. Every collective the process group runs leaves a ``gloo:<op>`` record with the
message's dimensions and element type; their bytes are summed per op and per step, on
each rank. Volume per rank counts an all-reduce twice (reduce-scatter + all-gather, as
the ZeRO paper does), an all-gather's output and a reduce-scatter's input once, a
broadcast or reduce once, and is divided by Psi = the model's parameter bytes.

Gloo has no reduce-scatter: torch runs ``reduce_scatter_tensor`` on gloo as an all-reduce
of the full input (the ``c10d::_reduce_scatter_base_`` record sits over a
``gloo:all_reduce`` one). The "NCCL" column counts those as the reduce-scatters they
are. Prints a Markdown table and writes outputs/benchmarks/communication.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from benchmarks.common import markdown, save, spawn_ranks, strategy_names
from sharded_exp.compose import compose

STRATEGY_NAMES = strategy_names()
# The ZeRO paper's per-rank volume per step, in units of Psi (fp32 parameter bytes).
THEORY = {"ddp": 2, "oss": 2, "sharded_ddp": 2, "zero1": 2, "fsdp_grad_op": 2, "fsdp": 3}
STAGE = {
    "ddp": "DDP",
    "oss": "ZeRO-1",
    "sharded_ddp": "ZeRO-2",
    "zero1": "ZeRO-1",
    "fsdp_grad_op": "ZeRO-2",
    "fsdp": "ZeRO-3",
}
BYTES = {
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "double": 8,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "unsigned char": 1,
}


def _bytes(dims, dtype) -> int:
    n = 1
    for d in dims:
        n *= d
    return n * BYTES.get(dtype, 4)


def collective_bytes(trace: dict, world_size: int) -> dict[str, float]:
    """Per-op bytes from a Chrome trace: payload (message bytes) and volume (see module doc)."""
    out: dict[str, float] = defaultdict(float)
    for event in trace["traceEvents"]:
        name, args = event.get("name", ""), event.get("args", {})
        dims, types = args.get("Input Dims"), args.get("Input type")
        if not dims or not types:
            continue
        if name.startswith("gloo:"):
            op = name[len("gloo:") :]
            size = _bytes(dims[0], types[0])
            out[f"{op}/calls"] += 1
            out[f"{op}/payload"] += size
            factor = {"all_reduce": 2, "all_gather": world_size}.get(op, 1)
            out["volume"] += factor * size
        elif name == "c10d::_reduce_scatter_base_":
            # Inputs (output, input): the logical reduce-scatter over the full input.
            out["reduce_scatter/calls"] += 1
            out["reduce_scatter/input"] += _bytes(dims[1], types[1])
    return dict(out)


def profile_rank(rank: int, world_size: int, cfg_data: dict, warmup: int, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from sharded_exp.train.build import build_run
    from sharded_exp.train.step import train_step

    cfg = OmegaConf.create(cfg_data)
    device = torch.device("cpu")
    run = build_run(cfg, device)
    params = sum(p.numel() for p in run.module.parameters())
    strategy, next_batch, autocast = run.strategy, run.task, run.autocast
    for step in range(warmup):
        train_step(strategy, [next_batch(step, 0, rank)], autocast, cfg.trainer.grad_clip)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in range(warmup, warmup + steps):
            train_step(strategy, [next_batch(step, 0, rank)], autocast, cfg.trainer.grad_clip)
        dist.barrier()  # its own gloo record is taken out below
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    counts = collective_bytes(trace, world_size)
    per_step = {k: v / steps for k, v in counts.items()}
    per_step["params"] = params
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, per_step)
    return gathered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=STRATEGY_NAMES)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    parser.add_argument("--smoke", action="store_true", help="one strategy, one step (CI)")
    parser.add_argument(
        "overrides", nargs="*", default=["model=gpt", "model.d_model=128", "model.n_layers=2", "trainer.batch_size=4"]
    )
    args = parser.parse_args()
    if args.smoke:
        args.strategies, args.steps = args.strategies[:1], 1

    rows, data = [], []
    for strategy in args.strategies:
        overrides = [f"strategy={strategy}", f"trainer.world_size={args.world_size}", "logger=none", *args.overrides]
        cfg_data = OmegaConf.to_container(compose(overrides), resolve=True, enum_to_str=True)
        ranks = spawn_ranks(profile_rank, args.world_size, cfg_data, 2, args.steps)
        psi = ranks[0]["params"] * 4
        barrier = 2 * 4  # one 1-element all-reduce per rank: dist.barrier() on gloo
        volume = max(r.get("volume", 0) for r in ranks) - barrier / args.steps
        # On NCCL a reduce-scatter moves its input once; gloo's all-reduce moved it twice.
        nccl = volume - max(r.get("reduce_scatter/input", 0) for r in ranks)
        ops = sorted({k.split("/")[0] for r in ranks for k in r if k.endswith("/payload")})
        detail = ", ".join(
            f"{op} {ranks[0].get(f'{op}/calls', 0):g}x {ranks[0].get(f'{op}/payload', 0) / psi:.2f}" for op in ops
        )
        data.append({"strategy": strategy, "psi_bytes": psi, "per_rank": ranks, "volume": volume, "nccl_volume": nccl})
        rows.append(
            [
                strategy,
                STAGE[strategy],
                f"{volume / 2**20:.2f}",
                f"{volume / psi:.2f}",
                f"{nccl / psi:.2f}",
                THEORY[strategy],
                detail,
            ]
        )
    params = data[0]["per_rank"][0]["params"]
    print(
        f"{' '.join(args.overrides)}; {params:,} params, Psi = {params * 4 / 2**20:.2f} MiB; world size "
        f"{args.world_size}; per rank per step (max over ranks), {args.steps} profiled steps"
    )
    header = [
        "strategy",
        "stage",
        "MiB/step",
        "volume/Psi (gloo)",
        "volume/Psi (NCCL)",
        "theory/Psi",
        "ops: calls/step, payload/Psi",
    ]
    print(markdown(header, rows))
    print(f"wrote {save('communication', {'args': vars(args), 'results': data})}")


if __name__ == "__main__":
    main()
