"""One-line mutations of pure logic that the unit tier must catch: proof that the unit tests
test something. Each mutation changes one line of the package (a sign, an off-by-one, the wrong
row or branch); the unit tests must fail under every one of them.

    python -m tests.regression.mutations list                 # the mutations, numbered
    python -m tests.regression.mutations apply 7              # mutate the working tree (undo: git checkout -- FILE)
    python -m tests.regression.mutations check                # each in a scratch copy: the unit tier must fail
    python -m tests.regression.mutations check 3 7 --named    # only the named test's module, faster

``check`` copies the repository (without .git, .venv and outputs) into a temporary directory,
runs the unit tier there once unmutated (it must pass), then once per mutation with that one
line changed (it must fail), and exits 1 naming any mutation that survived. The working tree is
never touched. ``tests/regression/test_mutations.py`` checks that every line named here still
exists exactly once, so the list cannot rot silently.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    number: int
    file: str
    old: str
    """Text found in exactly one line of ``file``; that occurrence is replaced by ``new``."""
    new: str
    what: str
    caught_by: str
    """A unit test that fails under the mutation (pytest node id)."""

    def apply(self, root: Path) -> None:
        path = root / self.file
        lines = path.read_text().splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if self.old in line]
        if len(hits) != 1:
            raise ValueError(f"mutation {self.number}: {self.old!r} is in {len(hits)} lines of {self.file}, not 1")
        lines[hits[0]] = lines[hits[0]].replace(self.old, self.new, 1)
        path.write_text("".join(lines))


MUTATIONS = [
    Mutation(
        1,
        "sharded_exp/predict/fake_step.py",
        "if not -self.n <= index < self.n:",
        "if not -self.n <= index <= self.n:",
        "lazy FSDP chunks accept index n (off-by-one bound)",
        "tests/unit/predict/test_fake_step.py::test_lazy_chunks_refuse_an_index_out_of_range",
    ),
    Mutation(
        2,
        "sharded_exp/predict/memory_model.py",
        "return sum(2 * element * n + FP32 for n in numels)",
        "return sum(2 * element * n for n in numels)",
        "Adam's per-tensor fp32 step counter dropped from the optimizer state",
        "tests/unit/predict/test_memory_model.py::test_adam_state_is_two_moments_per_element_and_a_step_per_tensor",
    ),
    Mutation(
        3,
        "sharded_exp/predict/prediction.py",
        "peak - sum(p.get(k, 0.0) * (1 - other[s] / mine[s]) for k, s in scaled.items() if mine[s])",
        "peak + sum(p.get(k, 0.0) * (1 - other[s] / mine[s]) for k, s in scaled.items() if mine[s])",
        "another rank's peak raised, not lowered, by its smaller states (sign flip)",
        "tests/unit/predict/test_prediction.py::test_another_ranks_peak_is_lower_by_its_smaller_states_and_step_temporaries",
    ),
    Mutation(
        4,
        "sharded_exp/measure/cuda_kernels.py",
        "if capability is not None and capability[0] < 9:",
        "if capability is not None and capability[0] <= 9:",
        "Hopper (9.x) given the pre-Hopper cuBLAS workspace (off-by-one)",
        "tests/unit/measure/test_cuda_kernels.py::test_the_workspace_defaults_are_torchs_per_compute_capability",
    ),
    Mutation(
        5,
        "sharded_exp/measure/flops.py",
        "if mfu is not None and mfu > 1:",
        "if mfu is not None and mfu >= 1:",
        "an MFU of exactly 100% treated as untrusted (wrong comparison)",
        "tests/unit/measure/test_flops.py::test_an_mfu_above_100_percent_is_null_and_the_peak_not_trusted",
    ),
    Mutation(
        6,
        "sharded_exp/measure/tracker.py",
        "if key not in seen and st.nbytes() > 0:",
        "if st.nbytes() > 0:",
        "a storage shared by views counted once per view",
        "tests/unit/measure/test_tracker.py::test_storage_bytes_count_each_storage_once_and_skip_meta_none_and_empty",
    ),
    Mutation(
        7,
        "sharded_exp/plan/command.py",
        "if p.params is None and max(p.world_sizes) > MAX_FAKED_RANKS:",
        "if p.params is None and max(p.world_sizes) >= MAX_FAKED_RANKS:",
        "the largest world size a model is faked at refused (off by one)",
        "tests/unit/plan/test_command.py::test_input_the_planner_takes",
    ),
    Mutation(
        8,
        "sharded_exp/plan/depth.py",
        "steps = (layers - b.depth) / (b.depth - a.depth)",
        "steps = (layers - a.depth) / (b.depth - a.depth)",
        "compose draws the lines from the first fake's depth, not the second's (one block too far)",
        "tests/unit/plan/test_depth.py::test_compose_draws_each_line_to_full_depth_over_the_largest_ranks_states",
    ),
    Mutation(
        9,
        "sharded_exp/plan/depth.py",
        "reuse = first is not None and not strategy.depth_lines_per_world_size and isinstance(fakes[0], Fake)",
        "reuse = first is not None and strategy.depth_lines_per_world_size and isinstance(fakes[0], Fake)",
        "the per-world-size flag inverted: DDP's unchanged lines redrawn, ShardedDDP's reused",
        "tests/unit/plan/test_depth.py::test_ddp_is_drawn_once_and_reused_where_its_lines_do_not_move",
    ),
    Mutation(
        10,
        "sharded_exp/plan/points.py",
        "return int(min(crossings)) if crossings else 2 * lo",
        "return int(max(crossings)) if crossings else 2 * lo",
        "the last phase to reach the budget decides the next probe, not the first",
        "tests/unit/plan/test_points.py::test_the_first_phase_to_reach_the_budget_decides_the_crossing",
    ),
    Mutation(
        11,
        "sharded_exp/plan/points.py",
        "line[k] = max(0.0, a + b / world_size)",
        "line[k] = max(0.0, a + b / w3)",
        "a raw plan beyond 1024 ranks read off the line at the window's last world size, not the one asked",
        "tests/unit/plan/test_points.py::test_a_line_that_holds_only_past_a_regime_change_answers_beyond_it",
    ),
    Mutation(
        12,
        "sharded_exp/plan/progress.py",
        "left = elapsed / self.count * (self.total - self.count)",
        "left = elapsed / self.count * (self.total - self.count + 1)",
        "the time left counts one point too many",
        "tests/unit/plan/test_progress.py::test_each_point_done_is_a_line_with_the_time_so_far_and_left",
    ),
    Mutation(
        13,
        "sharded_exp/plan/table.py",
        'big = max((r["total_gib"] or 0 for r in rows), default=0) >= 1',
        'big = max((r["total_gib"] or 0 for r in rows), default=0) > 1',
        "a plan peaking at exactly 1 GiB drawn in MiB",
        "tests/unit/plan/test_table.py::test_memory_is_in_gib_from_one_gib_and_in_mib_below",
    ),
    Mutation(
        14,
        "sharded_exp/train/records.py",
        "memory_end = start + min(max(warmup, 2), left)",
        "memory_end = start + min(max(warmup, 1), left)",
        "the CPU tracker's window covers one step, not two at least",
        "tests/unit/train/test_loop.py::test_on_cpu_the_tracker_covers_at_least_two_steps_and_they_are_not_timed",
    ),
    Mutation(
        15,
        "sharded_exp/train/metrics.py",
        "self.first_nonfinite = step - n + 1 + bad[0]  # the interval's steps are consecutive",
        "self.first_nonfinite = step - n + bad[0]  # the interval's steps are consecutive",
        "first non-finite step off by one",
        "tests/unit/train/test_components.py::test_metrics_name_the_first_step_whose_loss_was_not_finite",
    ),
    Mutation(
        16,
        "sharded_exp/train/step.py",
        "with contextlib.nullcontext() if i == n - 1 else strategy.no_sync():",
        "with contextlib.nullcontext() if i == 0 else strategy.no_sync():",
        "gradients communicated on the first micro-batch instead of the last",
        "tests/unit/train/test_step.py::test_micro_batches_average_their_losses_and_sync_on_the_last_only",
    ),
    Mutation(
        17,
        "sharded_exp/checkpoint/manager.py",
        "return bool(self.every) and (steps_done % self.every == 0 or steps_done == steps)",
        "return bool(self.every) and (steps_done % self.every == 0 or steps_done == steps - 1)",
        "the final checkpoint is due one step early",
        "tests/unit/checkpoint/test_manager.py::test_due_steps_are_the_multiples_of_every_and_the_last_step",
    ),
    Mutation(
        18,
        "sharded_exp/checkpoint/plan.py",
        'if t.resume == "auto" and start >= t.steps:',
        'if t.resume == "auto" and start > t.steps:',
        "resume=auto at exactly trainer.steps is no longer 'nothing to do'",
        "tests/unit/checkpoint/test_plan.py::test_resume_auto_on_a_finished_job_is_nothing_to_do",
    ),
    Mutation(
        19,
        "sharded_exp/checkpoint/plan.py",
        "later = [path for step, path in complete_checkpoints(directory) if step > start]",
        "later = [path for step, path in complete_checkpoints(directory) if step >= start]",
        "the resumed checkpoint itself counts as a later one and is refused",
        "tests/unit/checkpoint/test_plan.py::test_resuming_the_newest_checkpoint_is_not_refused",
    ),
    Mutation(
        20,
        "sharded_exp/checkpoint/state.py",
        'if len(train["rng"]) == dist.get_world_size():',
        'if len(train["rng"]) != dist.get_world_size():',
        "RNG restored only at a different world size",
        "tests/unit/checkpoint/test_state.py::test_restore_brings_back_model_optimizer_and_the_rng_at_the_same_world_size",
    ),
    Mutation(
        21,
        "sharded_exp/checkpoint/storage.py",
        "if keep > 0:",
        "if keep > 1:",
        "keep_checkpoints=1 keeps every checkpoint",
        "tests/unit/checkpoint/test_storage.py::test_publish_with_keep_one_keeps_the_checkpoint_just_written",
    ),
    Mutation(
        22,
        "sharded_exp/checkpoint/storage.py",
        '"step": lambda v: is_int(v) and v >= 0,',
        '"step": lambda v: is_int(v) and v > 0,',
        "a checkpoint at step 0 is called corrupt",
        "tests/unit/checkpoint/test_storage.py::test_read_meta_accepts_the_smallest_valid_values",
    ),
    Mutation(
        23,
        "sharded_exp/report/rows.py",
        'if ddp is not None and ddp["status"] == "ok":',
        "if ddp is not None:",
        "the DDP point is chosen as baseline even when it ran out of memory / failed (wrong baseline row)",
        "tests/unit/report/test_rows.py::test_when_ddp_does_not_fit_the_least_sharded_point_that_fits_is_the_baseline",
    ),
    Mutation(
        24,
        "sharded_exp/report/statistics.py",
        "return a_low / b_high, a_high / b_low",
        "return a_low / b_low, a_high / b_high",
        "the speed ratio's 95% interval pairs the wrong ends (no longer the conservative lowest/highest, highest/lowest)",
        "tests/unit/report/test_rows.py::test_speed_is_the_ratio_of_throughputs_with_a_conservative_interval",
    ),
    Mutation(
        25,
        "sharded_exp/report/rows.py",
        'row["speed_within_noise"] = (low <= 1.0 <= high) if low is not None and base is not row else None',
        'row["speed_within_noise"] = (low < 1.0 <= high) if low is not None and base is not row else None',
        "an interval whose lower end is exactly 1.0 no longer counts as within noise (off-by-one comparison)",
        "tests/unit/report/test_rows.py::test_an_interval_that_holds_one_is_within_noise",
    ),
    Mutation(
        26,
        "sharded_exp/strategies/residency.py",
        "order = sorted(range(len(group)), key=lambda i: -group[i]) if largest_first else range(len(group))",
        "order = sorted(range(len(group)), key=lambda i: group[i]) if largest_first else range(len(group))",
        "ZeRO-1's partition visits the smallest tensors first (flipped sign)",
        "tests/unit/strategies/test_residency.py::test_largest_first_visits_each_group_by_size_but_reports_owners_in_parameter_order",
    ),
    Mutation(
        27,
        "sharded_exp/strategies/fsdp.py",
        "return root_numel + max(block_numels, default=0)",
        "return root_numel + sum(block_numels)",
        "FSDP with resharding counts every unit gathered at the peak instead of the largest one",
        "tests/unit/strategies/test_fsdp.py::test_with_resharding_the_root_and_the_largest_unit_are_gathered_without_it_every_unit",
    ),
    Mutation(
        28,
        "sharded_exp/strategies/fsdp.py",
        "rank = rank % world_size",
        "rank = rank // world_size",
        "HSDP: a rank's place in its shard group taken as the group index",
        "tests/unit/strategies/test_fsdp.py::test_params_and_grads_are_padded_and_optimizer_state_follows_the_real_shard",
    ),
    Mutation(
        29,
        "sharded_exp/strategies/sharded_ddp.py",
        "if capacity > 0 and fill[dst] + numels[i] < capacity:",
        "if capacity > 0 and fill[dst] + numels[i] <= capacity:",
        "a gradient that would fill a reduce bucket exactly is bucketed (fairscale leaves it out)",
        "tests/unit/strategies/test_sharded_ddp.py::test_buckets_fill_smallest_first_and_a_tensor_that_would_fill_one_exactly_is_left_out",
    ),
    Mutation(
        30,
        "sharded_exp/models/__init__.py",
        "return list(max(lists, key=len)) if lists else []",
        "return list(min(lists, key=len)) if lists else []",
        "the units finder takes the shortest list of blocks instead of the longest",
        "tests/unit/models/test_init.py::test_the_longest_list_of_blocks_is_the_units_the_first_among_equals",
    ),
    Mutation(
        31,
        "sharded_exp/probe/fake.py",
        "return {TEMP: beside, **({BUCKET: beside} if buckets_seen else {})}",
        "return {TEMP: beside, **({BUCKET: beside} if not buckets_seen else {})}",
        "DDP's bucket copy added only where the measurement cannot see it (wrong branch)",
        "tests/unit/probe/test_fake.py::test_ddp_adds_two_gradient_copies_one_of_them_the_bucket_only_where_it_is_seen",
    ),
    Mutation(
        32,
        "sharded_exp/launch/layout.py",
        "out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))",
        "out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi)))",
        "off-by-one: a SLURM node range drops its last host",
        "tests/unit/launch/test_layout.py::test_expand_nodelist_lists_every_host_in_order",
    ),
    Mutation(
        33,
        "sharded_exp/launch/preflight.py",
        "need = sum(sorted(per_rank_mib, reverse=True)[:local_ranks]) + RANK_OVERHEAD_MIB * local_ranks",
        "need = sum(sorted(per_rank_mib)[:local_ranks]) + RANK_OVERHEAD_MIB * local_ranks",
        "host-memory check sums the smallest per-rank peaks instead of the largest",
        "tests/unit/launch/test_preflight.py::test_host_memory_counts_the_largest_peaks_of_the_local_ranks_plus_their_processes",
    ),
    Mutation(
        34,
        "sharded_exp/data/loader.py",
        "self.epoch, self.batch = self.epoch + self.batch // self.per_epoch, self.batch % self.per_epoch",
        "self.epoch, self.batch = self.epoch, self.batch % self.per_epoch",
        "a resumed data position past an epoch's end no longer rolls into the next epoch",
        "tests/unit/data/test_loader.py::test_a_position_of_more_than_an_epoch_rolls_into_the_next_ones",
    ),
]


def unit_tier_passes(root: Path, target: str) -> tuple[bool, float]:
    """Whether ``pytest -x TARGET`` passes in ``root`` (its own copy of the package is imported
    first: the repository root is on ``sys.path`` before site-packages), and its seconds."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", target],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1800,  # the unit tier takes under a minute: only a hung run reaches this
    )
    return proc.returncode == 0, time.perf_counter() - start


def scratch_copy() -> Path:
    where = Path(tempfile.mkdtemp(prefix="mutations-"))
    ignore = shutil.ignore_patterns(".git", ".venv*", "outputs", "__pycache__", "site", "*.egg-info")
    shutil.copytree(ROOT, where / "repo", ignore=ignore, symlinks=True)
    return where / "repo"


def check(numbers: list[int], named: bool) -> int:
    chosen = [m for m in MUTATIONS if not numbers or m.number in numbers]
    repo = scratch_copy()
    try:
        ok, seconds = unit_tier_passes(repo, "tests/unit")
        print(f"unmutated: the unit tier {'passes' if ok else 'FAILS'} ({seconds:.1f} s)")
        if not ok:
            return 1
        survivors = []
        for m in chosen:
            path = repo / m.file
            original = path.read_text()
            m.apply(repo)
            try:
                target = m.caught_by.split("::")[0] if named else "tests/unit"
                passed, seconds = unit_tier_passes(repo, target)
            finally:
                path.write_text(original)
            print(f"{m.number:3d} {'SURVIVED' if passed else 'caught  '} {seconds:5.1f} s  {m.file}: {m.what}")
            if passed:
                survivors.append(m.number)
        print(
            f"{len(chosen) - len(survivors)} of {len(chosen)} caught"
            + (f"; survived: {survivors}" if survivors else "")
        )
        return 1 if survivors else 0
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    apply = sub.add_parser("apply")
    apply.add_argument("number", type=int)
    checking = sub.add_parser("check")
    checking.add_argument("numbers", type=int, nargs="*")
    checking.add_argument("--named", action="store_true", help="run only the module of the test named as its catcher")
    args = parser.parse_args(argv)
    if args.command == "list":
        for m in MUTATIONS:
            print(
                f"{m.number:3d}  {m.file}: {m.what}\n       - {m.old}\n       + {m.new}\n       caught by {m.caught_by}"
            )
        return 0
    if args.command == "apply":
        (m,) = [m for m in MUTATIONS if m.number == args.number] or [None]
        if m is None:
            print(f"error: no mutation {args.number}; there are 1-{len(MUTATIONS)}", file=sys.stderr)
            return 2
        m.apply(ROOT)
        print(f"mutated {m.file} ({m.what}); undo with: git checkout -- {m.file}")
        return 0
    return check(args.numbers, args.named)


if __name__ == "__main__":
    sys.exit(main())
