"""Which optimizer steps one call of the compiled step runs, and which run
part by part to be timed: a function of the step number and the
`TrainConfig` alone (no TensorFlow), so an interrupted and resumed run
makes exactly the calls an uninterrupted one makes, and reports and saves
at the same steps. It reads four numbers of the config, so any object with
them plans (a `TrainConfig` in the Trainer).
"""


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

    def steps_in_call(self, step: int, most: int) -> int:
        """How many steps, from step number `step` on, the next call runs:
        one for a timed step; else up to `steps_per_execution` and `most`,
        ending before the next timed step and at the next log or checkpoint
        boundary. A function of the step number alone (resume: the same
        calls), so the loop reports and saves where one step at a time would.
        """
        if self.is_timed(step):
            return 1
        config = self._config
        n = min(config.steps_per_execution, most)
        boundaries = [config.log_steps, config.save_checkpoints_steps]
        for every in boundaries:
            if every:
                n = min(n, every - (step - 1) % every)
        for ahead in range(1, n):
            if self.is_timed(step + ahead):
                return ahead
        return n
