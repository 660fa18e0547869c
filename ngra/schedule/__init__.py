"""Schedule search after Tessel: which block (a stage's forward or backward for one micro-batch, or
any unit of work) runs when on which device.

- :mod:`~ngra.schedule.core`: blocks, problems, schedules, the checker, the simulator, a text
  printer and a matplotlib Gantt chart;
- :mod:`~ngra.schedule.placements`: pipeline problems (linear, loop, V-shape, M-shape);
- :mod:`~ngra.schedule.baselines`: GPipe, 1F1B, interleaved 1F1B, greedy, brute force;
- :mod:`~ngra.schedule.search`: exact search with z3 and Tessel's repetend + completion;
- :mod:`~ngra.schedule.execute`: running a schedule over torch.distributed point-to-point, and
  measuring the stage and transfer costs a search takes (calibration);
- :mod:`~ngra.schedule.streaming`: the order of halo transfers and destination columns of one
  worker's streamed call on a distributed graph (``ngra.Engine(column_order="searched")``).
"""

from .baselines import (best_standard, brute_force, gpipe, greedy, interleaved_1f1b, one_f_one_b,
                        standard)
from .core import (Block, Problem, Schedule, ScheduleError, check, format_schedule, peak_memory,
                   plot_schedule, simulate)
from .placements import linear, loop, mshape, pipeline_problem, vshape
from .crossover import compare_policies, simulate_crossover  # noqa: F401 - time-sharing
from .streaming import StreamCosts, StreamingOrder, plan_streaming_order

__all__ = ["Block", "Problem", "Schedule", "ScheduleError", "check", "simulate", "peak_memory",
           "format_schedule", "plot_schedule", "pipeline_problem", "linear", "loop", "vshape",
           "mshape", "gpipe", "one_f_one_b", "interleaved_1f1b", "greedy", "brute_force",
           "standard", "best_standard", "StreamCosts", "StreamingOrder",
           "plan_streaming_order"]
