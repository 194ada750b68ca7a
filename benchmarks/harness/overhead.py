"""What the harness costs: the trainer's loop against a minimal hand-written loop.

    python -m benchmarks.harness.overhead                          # every strategy, MLP, fp32, 2 ranks
    python -m benchmarks.harness.overhead --strategies ddp --logger wandb
    python -m benchmarks.harness.overhead --smoke                  # CI: one strategy, one short round

Both loops run in the same rank processes, on the same model, data, strategy objects
(built once by the registry), precision and thread count, alternately: round r runs the
trainer's real loop (``sharded_exp.train.loop.run_loop``, with its stop checks, metrics,
logging, step timing) then the hand-written loop, or the other way round. The
hand-written loop is what a user would type: batch, zero_grad, autocast forward, scaled
backward, unscale, clip, step, update. Both are timed the same way: wall time of whole
loop iterations after the warm-up, divided by the timed steps. Each round gives one
ratio trainer/hand; the table shows the median ratio and its range. (Separate jobs
were tried first: run-to-run noise on a shared 2-core machine was +-10%, larger than
the effect measured.)

Loop ratios still carry that machine's noise (two loops run seconds apart). The
"harness" columns do not: within each loop the time of the step itself is measured too,
and the harness cost is the trainer's time outside its steps minus the hand loop's
(which is the batch alone), per step, as a share of the hand loop's step.
Prints a Markdown table, writes outputs/benchmarks/overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from omegaconf import OmegaConf

from benchmarks.common import OUT, markdown, save, spawn_ranks, strategy_names
from sharded_exp.compose import compose

STRATEGY_NAMES = strategy_names()


def hand_loop(strategy, next_batch, autocast, grad_clip: float, rank: int, steps: int, warmup: int) -> tuple:
    """A minimal training loop over the same objects: (seconds per loop iteration, mean
    seconds of the step itself), like the trainer's loop_time_s_per_step and step_time_s_mean."""
    model, optimizer, scaler = strategy.model, strategy.optimizer, strategy.scaler
    inside = 0.0
    for step in range(steps):
        if step == warmup:
            start, inside = time.perf_counter(), 0.0
        batch = next_batch(step, 0, rank)
        t0 = time.perf_counter()
        strategy.zero_grad()
        with autocast:
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        strategy.clip_grad_norm_(grad_clip)
        scaler.step(optimizer)
        scaler.update()
        inside += time.perf_counter() - t0
    return (time.perf_counter() - start) / (steps - warmup), inside / (steps - warmup)


def rounds(rank: int, world_size: int, cfg_data: dict, rounds: int, out_dir: str) -> list[dict]:
    """On every rank: build once, then alternate the trainer's loop and the hand loop."""
    from sharded_exp.measure.tracker import MemoryMeter
    from sharded_exp.output.loggers import build_logger
    from sharded_exp.train import liveness
    from sharded_exp.train.build import build_run
    from sharded_exp.train.loop import LoopSettings, run_loop

    cfg = OmegaConf.create(cfg_data)
    tc = cfg.trainer
    device = torch.device("cpu")
    run = build_run(cfg, device)
    strategy, next_batch, autocast = run.strategy, run.task, run.autocast
    logger = build_logger(cfg.logger, cfg_data, out_dir, rank)
    liveness.catch_stop_signals()
    results = []
    for r in range(rounds):
        times = {}
        for side in ("trainer", "hand") if r % 2 == 0 else ("hand", "trainer"):
            if side == "hand":
                times["hand"], times["hand_step"] = hand_loop(
                    strategy, next_batch, autocast, tc.grad_clip, rank, tc.steps, tc.warmup_steps
                )
            else:
                out = run_loop(
                    strategy,
                    next_batch,
                    autocast,
                    LoopSettings.from_config(tc),
                    meter=MemoryMeter(device, None),  # not started: the trainer measures memory in warm-up only
                    stopper=liveness.StopAgreement(),
                    logger=logger,
                )
                times["trainer"] = out.throughput["loop_time_s_per_step"]
                times["trainer_step"] = out.throughput["step_time_s_mean"]
        if rank == 0:
            # Outside the step (batch, bookkeeping): the trainer's minus the hand loop's,
            # each measured within the same iterations, so free of run-to-run noise.
            harness = (times["trainer"] - times["trainer_step"]) - (times["hand"] - times["hand_step"])
            results.append({**times, "ratio": times["trainer"] / times["hand"], "harness_s": harness})
    logger.finish(exit_code=0)
    return results


def job(strategy: str, args) -> list[str]:
    return [
        f"strategy={strategy}",
        f"model={args.model}",
        f"precision={args.precision}",
        f"logger={args.logger}",
        f"trainer.world_size={args.world_size}",
        f"trainer.steps={args.steps}",
        f"trainer.warmup_steps={args.warmup}",
        "trainer.progress_bar=false",
        *args.overrides,
    ]


def measure(strategy: str, args) -> dict:
    overrides = job(strategy, args)
    cfg_data = OmegaConf.to_container(compose(overrides), resolve=True, enum_to_str=True)
    out_dir = str(OUT / "overhead" / strategy)
    os.makedirs(out_dir, exist_ok=True)
    pairs = spawn_ranks(rounds, args.world_size, cfg_data, args.pairs, out_dir)
    hand = statistics.median(p["hand"] for p in pairs)
    harness = statistics.median(p["harness_s"] for p in pairs)
    return {
        "strategy": strategy,
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "harness_s_per_step": harness,
        "harness_share": harness / hand,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=STRATEGY_NAMES)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--logger", default="none")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=10, help="rounds, each one trainer run and one hand run")
    parser.add_argument("--target", type=float, default=1.03, help="trainer/hand ratio to meet")
    parser.add_argument("--smoke", action="store_true", help="one strategy, two short rounds (CI)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both sides")
    args = parser.parse_args()
    if args.smoke:
        args.strategies, args.steps, args.warmup, args.pairs = args.strategies[:1], 6, 2, 2

    rows, data = [], []
    for strategy in args.strategies:
        m = measure(strategy, args)
        data.append(m)
        ratios = [p["ratio"] for p in m["pairs"]]
        rows.append(
            [
                strategy,
                f"{statistics.median(p['hand'] for p in m['pairs']) * 1e3:.2f}",
                f"{statistics.median(p['trainer'] for p in m['pairs']) * 1e3:.2f}",
                f"{m['median_ratio']:.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                f"{m['harness_s_per_step'] * 1e3:.3f}",
                f"{m['harness_share']:.1%}",
                "yes" if 1 + m["harness_share"] <= args.target else "no",
            ]
        )
    print(
        f"model={args.model} precision={args.precision} logger={args.logger} world_size={args.world_size}, "
        f"{args.steps - args.warmup} timed steps per loop, {args.pairs} alternating rounds in the same ranks"
    )
    header = [
        "strategy",
        "hand ms/step",
        "trainer ms/step",
        "loop ratio (median)",
        "ratio range",
        "harness ms/step",
        "harness / hand loop",
        f"within {args.target - 1:.0%}",
    ]
    print(markdown(header, rows))
    print(f"wrote {save('overhead', {'args': vars(args), 'results': data})}")


if __name__ == "__main__":
    main()
