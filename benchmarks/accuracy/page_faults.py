"""The new pages a CPU step is priced for, against the page faults its ranks measure, under each malloc rule.

    python -m benchmarks.accuracy.page_faults            # MLP 8 x 1024, gpt, hf_gpt2; ddp and fsdp; 2 ranks
    python -m benchmarks.accuracy.page_faults --quick    # the MLP under ddp only

Each job is a real run under each ``trainer.host_mmap_threshold``: ``reuse`` (the default:
the heap never trimmed, blocks above 32 MiB mapped), ``dynamic`` (glibc's own rule) and
``fixed`` (4 MiB). Its result.json holds the time model's count of the pages a
step makes that glibc maps anew (``throughput.step_time_prediction.fresh_pages_per_step``,
from the run's own fake step) and each rank's measured minor page faults per timed step
(``memory.per_rank[].page_faults_per_step``, ``getrusage``). Counts, not times: a machine
whose pace moves does not move them. The step medians are printed beside them, measured in
the same minutes, to show what the faults cost. Writes outputs/benchmarks/page_faults.json.
"""

from __future__ import annotations

import argparse

from benchmarks.common import markdown, run, save

MODELS = {
    "mlp 8 x 1024": ["model=mlp", "model.depth=8", "model.hidden=1024", "trainer.batch_size=64"],
    "gpt small": ["model=gpt"],
    "hf_gpt2 small": ["model=hf_gpt2"],
}
RULES = ("reuse", "dynamic", "fixed")


def measure(model: str, overrides: list[str], strategy: str, rule: str, steps: int) -> dict:
    name = f"faults_{model.replace(' ', '_')}_{strategy}_{rule}"
    result = run([*overrides, f"strategy={strategy}", "trainer.world_size=2", f"trainer.steps={steps}",
                  f"trainer.host_mmap_threshold={rule}", "logger=none"], name, check=False)  # fmt: skip
    tp = result.get("throughput") or {}
    faults = [r.get("page_faults_per_step") for r in (result.get("memory") or {}).get("per_rank") or []]
    return {"model": model, "strategy": strategy, "rule": rule, "status": result["status"],
            "predicted_pages": (tp.get("step_time_prediction") or {}).get("fresh_pages_per_step"),
            "measured_faults": [f for f in faults if f is not None],
            "step_s": tp.get("step_time_s_median"), "predicted_step_s": tp.get("predicted_step_time_s")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the MLP under ddp only")
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    strategies = ("ddp",) if args.quick else ("ddp", "fsdp")
    rows = [measure(m, o, s, rule, args.steps) for m, o in models.items() for s in strategies for rule in RULES]

    def ms(v):
        return f"{1000 * v:.1f}" if v else "-"

    table = [[r["model"], r["strategy"], r["rule"], r["predicted_pages"] if r["predicted_pages"] is not None else "-",
              " / ".join(f"{f:,.0f}" for f in r["measured_faults"]) or "-", ms(r["step_s"]), ms(r["predicted_step_s"]),
              r["status"]] for r in rows]  # fmt: skip
    print("2 ranks; per step: the pages the time model counts, each rank's measured minor page faults")
    print(markdown(["model", "strategy", "rule", "pages predicted", "faults measured (rank 0 / 1)", "step ms",
                    "predicted ms", "status"], table))  # fmt: skip
    print(f"wrote {save('page_faults', rows)}")


if __name__ == "__main__":
    main()
