"""sharded_exp.launch.parent: what one launch holds (Launch): who writes, and the parent's
part of the timeline. The flow itself runs real ranks: tests/integration/."""

from __future__ import annotations

from sharded_exp.launch.layout import Layout
from sharded_exp.launch.parent import Launch


def launch_of(layout=None, started=None) -> Launch:
    return Launch(cfg=None, output_dir="/out", job_files={}, identity={}, started=started, launched=3.0, layout=layout)


def test_the_spawning_parent_and_rank_0_of_an_external_launcher_write():
    assert launch_of().is_writer
    torchrun = dict(world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    assert launch_of(Layout(rank=0, **torchrun)).is_writer
    assert not launch_of(Layout(rank=1, **torchrun)).is_writer


def test_the_parent_times_say_when_main_started_and_none_without_main():
    run = launch_of(started=(1.0, 2.0))
    run.validated = 4.0
    assert run.parent_times() == {"main": 1.0, "imported": 2.0, "launch": 3.0, "validated": 4.0}
    assert launch_of().parent_times()["main"] is None


def test_the_parent_times_say_when_the_ranks_were_released_where_they_waited():
    run = launch_of(started=(1.0, 2.0))
    run.validated, run.predicted = 4.0, 4.5  # the peak predicted while the ranks started
    assert run.parent_times()["predicted"] == 4.5
