"""How ZeRO's sharded optimizer (`zero/optimizer.py`) appears in a checkpoint: as the
unsharded Keras optimizer, each slot whole (gathered from every worker when
saved, this worker's slice kept when restored), so either restores into the
other on any worker count."""

import tensorflow as tf

from tfscale import _compat


class CheckpointView(_compat.trackable_base()[0]):
    """The sharded optimizer as the unsharded Keras optimizer checkpoints
    itself: `_iterations`, `_learning_rate` (a fixed rate), the trainable
    variables and `_variables` [iterations, (learning rate), then each
    variable's slots in Keras's order], each slot whole. A checkpoint of
    either restores into the other, on any worker count.

    Args:
        sharded: The `zero.ShardedOptimizer`.
    """

    def __init__(self, sharded):
        optimizer = sharded.optimizer
        own = list(optimizer.variables)  # unbuilt: iterations, rate
        slots = [_WholeSlot(sharded, name, i)
                 for i in range(len(sharded.variables))
                 for name in sharded.slot_names]
        self._children = {"_iterations": optimizer.iterations,
                          "_trainable_variables": _List(sharded.variables),
                          "_variables": _List(own + slots)}
        rate = getattr(optimizer, "_learning_rate", None)
        if isinstance(rate, tf.Variable) or hasattr(rate, "_value"):
            self._children["_learning_rate"] = rate

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return dict(self._children)


class _List(_compat.trackable_base()[0]):
    """A list in the object graph: children "0", "1", ..."""

    def __init__(self, items):
        self._items = list(items)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return {str(i): item for i, item in enumerate(self._items)}


class _WholeSlot(_compat.trackable_base()[0]):
    """One variable's slot, whole, as a checkpointed variable value."""

    def __init__(self, sharded, name: str, index: int):
        self._sharded = sharded
        self._name = name
        self._index = index

    def _serialize_to_tensors(self):
        _, save_spec = _compat.trackable_base()
        key = _compat.variable_value_key()
        # Lazy: read only when written (restoring asks for the dtype only).
        # On the slots' own device: a checkpoint whose tensors live on
        # several tasks' devices is restored in a tf.function, where
        # Keras's variables cannot take the values (no static shape).
        return {key: save_spec(
            lambda: self._sharded.whole_slot(self._name, self._index),
            "", key, dtype=tf.float32,
            device=self._sharded.slots[self._name].device)}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[_compat.variable_value_key()]
        self._sharded.restore_slot(self._name, self._index, value)
        return None
