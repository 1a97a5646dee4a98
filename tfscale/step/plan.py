"""Which optimizer steps one call of the compiled step runs, and which run
part by part to be timed: a function of the step number, the steps left in
the epoch and the `TrainConfig` alone (no TensorFlow), so an interrupted
and resumed run makes exactly the calls an uninterrupted one makes, and
reports and saves at the same steps. It reads four numbers of the config,
so any object with them plans (a `TrainConfig` in the Trainer).
"""

# The step that runs part by part, untimed, when the first epoch reaches a
# timed step: a process's first part-by-part step traces the part programs,
# and at step 2 that happens beside the first call's own tracing instead of
# inside the first log interval (where it cost a 100-step interval of a
# small CNN about a fifth of its rate). A run that never reaches a timed
# step never traces them.
WARM_UP_STEP = 2


class StepPlan:
    """The calls of a run's steps (`TrainConfig.steps_per_execution`,
    `log_steps`, `timed_steps_per_log`, `save_checkpoints_steps`).

    Args:
        config: The run's `TrainConfig`.
    """

    def __init__(self, config):
        self._config = config

    def is_timed(self, step: int) -> bool:
        """Whether step number `step` (1-based) runs part by part.

        A function of the step number alone, so an interrupted and resumed
        run takes exactly the same path at every step as an uninterrupted
        one: the last `timed_steps_per_log` steps of each log interval.
        """
        config = self._config
        remainder = step % config.log_steps
        return config.timed_steps_per_log > 0 and (
            remainder == 0 or
            remainder > config.log_steps - config.timed_steps_per_log)

    def part_by_part(self, step: int, most: int) -> bool:
        """Whether step number `step` runs part by part, `most` steps being
        left in its epoch (counting it): a timed step, or `WARM_UP_STEP`
        when a timed step comes before the epoch's end."""
        if self.is_timed(step):
            return True
        config = self._config
        if step != WARM_UP_STEP or config.timed_steps_per_log <= 0:
            return False
        first_timed = max(1, config.log_steps - config.timed_steps_per_log + 1)
        return first_timed <= step + most - 1

    def steps_in_call(self, step: int, most: int) -> int:
        """How many steps, from step number `step` on, the next call runs
        (`most` steps being left in the epoch): one for a step run part by
        part; else up to `steps_per_execution` and `most`, ending before the
        next part-by-part step and at the next log or checkpoint boundary. A
        function of the step number and the epoch's length alone (resume:
        the same calls), so the loop reports and saves where one step at a
        time would.
        """
        if self.part_by_part(step, most):
            return 1
        config = self._config
        n = min(config.steps_per_execution, most)
        boundaries = [config.log_steps, config.save_checkpoints_steps]
        for every in boundaries:
            if every:
                n = min(n, every - (step - 1) % every)
        for ahead in range(1, n):
            if self.part_by_part(step + ahead, most - ahead):
                return ahead
        return n
