"""Behaviour check for refactors: the final ``param_digest`` of every strategy on the MLP
and the GPT (8 steps, 2 warm-up, logger=none, same seeds).

    python -m tests.regression.digests                       # prints JSON, writes outputs/tests/regression/digests.json
    python -m tests.regression.digests --compare OLD.json    # and the largest difference from OLD

Save its output before a change that must not change numbers, run it again after, and
compare: the figures must be identical (same seeds, same data, same code path). The wider
check (loss histories, predictions, key sets, checkpoints and resume, faults, the planner, a
sweep's report) is ``tests/regression/golden.py``, which reads the strategy list from here.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import run, save, strategy_names

STRATEGY_NAMES = strategy_names()
MODELS = {"mlp": [], "gpt": ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32"]}
COMMON = ["trainer.steps=8", "trainer.warmup_steps=2", "logger=none", "trainer.progress_bar=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", help="an earlier digests.json to compare with")
    parser.add_argument("--smoke", action="store_true", help="one point (CI)")
    args = parser.parse_args()
    models = {"mlp": MODELS["mlp"]} if args.smoke else MODELS
    digests = {}
    for model, extra in models.items():
        for strategy in STRATEGY_NAMES[:1] if args.smoke else STRATEGY_NAMES:
            result = run([f"model={model}", f"strategy={strategy}", *extra, *COMMON], f"digests/{model}_{strategy}")
            digests[f"{model}/{strategy}"] = {**result["param_digest"], "final_loss": result["final_loss"]}
    print("| point | sum | l2 | final_loss |\n|---|---|---|---|")
    for key, d in digests.items():
        print(f"| {key} | {d['sum']!r} | {d['l2']!r} | {d['final_loss']!r} |")
    save("digests", digests)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        diffs = {k: max(abs(v[f] - old[k][f]) for f in v) for k, v in digests.items() if k in old}
        print(f"largest absolute difference from {args.compare}: {max(diffs.values()):.3g}")
        print("identical" if all(d == 0 for d in diffs.values()) else "DIFFERENT: " + json.dumps(diffs))


if __name__ == "__main__":
    main()
