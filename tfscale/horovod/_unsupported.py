"""Horovod features tfscale.horovod does not offer: each fails with one line
naming what to use instead, never silently."""


def unsupported(name: str, instead: str):
    """A function that raises NotImplementedError for Horovod's `name`."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"tfscale.horovod has no {name}: {instead}")
    refuse.__name__ = name
    refuse.__doc__ = f"Not offered: {instead}"
    return refuse


class Unsupported:
    """A stand-in module (`hvd.elastic`) whose every attribute refuses."""

    def __init__(self, name: str, instead: str):
        self._name = name
        self._instead = instead

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return unsupported(f"{self._name}.{attribute}", self._instead)


ELASTIC = ("no state is handed between live ranks: tfscale-run --min-np "
           "--max-np --host-discovery-script restarts the ranks on the hosts "
           "found from the job's last checkpoint (tfscale's Trainer, or "
           "your tf.train.CheckpointManager), and --max-restarts N after "
           "a failure; tfscale's Trainer resumes on any worker count")
TIMELINE = ("profile with TensorBoard (tf.profiler.experimental.start / "
            "the TensorBoard callback's profile_batch)")
