"""ZeRO stage 1 (`tfscale/zero/optimizer.py`): the sharded optimizer update equals
Keras's, its checkpoints are the unsharded layout, and a real BERT run on 2
workers ends where the unsharded run ends, resumes killed on 3 workers, and
resumes sharded from an unsharded checkpoint.

The fast tests simulate N workers in one process (each shard's update, the
sums between them done by the test); the slow ones are real runs of
run_pretraining.py through launch.local, on both backends.
"""

import os
import shutil
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.zero import optimizer as zero
from tfscale.zero import layout as zero_layout
from tfscale.errors import ConfigError
from tfscale.optim import Lamb
from tfscale.optim.schedules import WarmupPolynomialDecay

SHAPES = [(7, 5), (5,), (1,), (13, 3), (3,), (4, 4, 2), (2,)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 200])
def test_layout_puts_every_element_in_one_shard(n):
    layout = zero_layout.Layout(SHAPES, n, 0)
    seen = []
    for r in range(n):
        for p in layout.pieces_of(r):
            assert 0 <= p.offset and p.offset + p.stop - p.start <= (
                layout.shard_size)
            seen += [(p.variable, i) for i in range(p.start, p.stop)]
    expected = [(v, i) for v, s in enumerate(SHAPES)
                for i in range(int(np.prod(s)))]
    assert seen == expected
    assert layout.num_shards * layout.shard_size - layout.total < n
    values = [tf.reshape(tf.range(int(np.prod(s)), dtype=tf.float32) + 100 * v,
                         s) for v, s in enumerate(SHAPES)]
    for a, b in zip(layout.unflatten(layout.flatten(values)), values):
        np.testing.assert_array_equal(a, b)


class FakeCollectives:
    """Shard `worker_index` of `num_replicas`; the test does the sums."""

    def __init__(self, n, r):
        self.num_replicas = self.num_workers = n
        self.worker_index = r


def make_optimizer(kind, variables):
    schedule = WarmupPolynomialDecay(0.05, 2, 10, 0.0, 1.0)
    if kind == "sgd":
        opt = keras.optimizers.SGD(0.1)
    elif kind == "sgd_nesterov_decay":
        opt = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True,
                                   weight_decay=0.01)
    elif kind == "adamw":
        opt = keras.optimizers.AdamW(schedule, weight_decay=0.1)
        opt.exclude_from_weight_decay(var_list=[variables[1]])
    else:
        opt = Lamb(schedule, weight_decay_rate=0.01,
                   exclude_from_weight_decay=["bias"])
    return opt


def make_variables():
    rng = np.random.RandomState(1)
    return [keras.Variable(rng.randn(*s).astype("float32"),
                           name="bias" if len(s) == 1 else f"kernel_{i}")
            for i, s in enumerate(SHAPES)]


def sharded_steps(kind, n, grads_per_step):
    """The sharded update of n workers, simulated: each shard's arithmetic,
    then the sums (LAMB's norms) and the gather done here."""
    variables = make_variables()
    optimizer = make_optimizer(kind, variables)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    # XLA-compiled, as the Trainer compiles both updates (compile_update).
    shards = [zero.ShardedOptimizer(optimizer, variables,
                                    FakeCollectives(n, r), strategy,
                                    jit_compile=True)
              for r in range(n)]
    layout = shards[0].layout
    for grads in grads_per_step:
        flat = layout.flatten(grads)
        size = layout.shard_size
        outs = [s._step_fn(flat[r * size:(r + 1) * size])
                for r, s in enumerate(shards)]
        if kind == "lamb":
            norms = tf.add_n([partial for _, partial in outs])
            outs = [s._finish_fn(out, norms)
                    for s, (out, _) in zip(shards, outs)]
        for v, value in zip(variables, layout.unflatten(tf.concat(outs, 0))):
            v.assign(value)
        optimizer.iterations.assign_add(1)
    return variables, shards


def keras_steps(kind, grads_per_step):
    variables = make_variables()
    optimizer = make_optimizer(kind, variables)
    optimizer.build(variables)
    apply = tf.function(lambda grads: optimizer.apply(grads, variables),
                        jit_compile=True)
    for grads in grads_per_step:
        apply(grads)
    return variables, optimizer


def gradients(steps=3):
    rng = np.random.RandomState(2)
    return [[tf.constant(rng.randn(*s).astype("float32")) for s in SHAPES]
            for _ in range(steps)]


@pytest.mark.parametrize("kind", ["sgd", "sgd_nesterov_decay", "adamw",
                                  "lamb"])
@pytest.mark.parametrize("n", [2, 7])  # (3: the real runs below)
def test_sharded_update_is_keras_update(kind, n):
    grads = gradients()
    sharded, shards = sharded_steps(kind, n, grads)
    plain, optimizer = keras_steps(kind, grads)
    for a, b in zip(sharded, plain):
        if kind == "lamb":  # its norms: sums of per-shard sums
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                       atol=1e-7)
        else:
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    # The slots, gathered from the shards, are Keras's.
    names = zero.slot_names(optimizer, shards[0].kind)
    whole = {name: np.concatenate([s.slots[name].numpy() for s in shards])
             for name in names}
    slots = [v for v in optimizer.variables
             if v is not optimizer.iterations and "learning_rate" not in v.path]
    layout = shards[0].layout
    for i in range(len(SHAPES)):
        for j, name in enumerate(names):
            expected = slots[i * len(names) + j].numpy().ravel()
            got = whole[name][layout.offsets[i]:layout.offsets[i] +
                              layout.sizes[i]]
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # Each worker holds 1/n of them.
    assert shards[0].state_bytes == 4 * layout.shard_size * len(names)


def checkpoint_keys(path):
    return sorted(k for k, _ in tf.train.list_variables(path)
                  if k != "_CHECKPOINTABLE_OBJECT_GRAPH")


@pytest.mark.parametrize("kind", ["sgd_nesterov_decay", "adamw", "lamb"])
def test_checkpoint_is_the_unsharded_layout_both_ways(kind, tmp_path):
    grads = gradients(2)
    plain, optimizer = keras_steps(kind, grads)
    written = tf.train.Checkpoint(optimizer=optimizer).write(
        str(tmp_path / "plain"))
    # An unsharded checkpoint restored into shard 1 of 3 keeps its slice.
    variables = make_variables()
    shard = zero.ShardedOptimizer(make_optimizer(kind, variables), variables,
                                  FakeCollectives(3, 1),
                                  tf.distribute.OneDeviceStrategy("/cpu:0"))
    tf.train.Checkpoint(optimizer=shard.checkpoint_view()).restore(
        written).expect_partial()
    sharded, shards = sharded_steps(kind, 3, grads)
    for name in shard.slot_names:
        np.testing.assert_allclose(shard.slots[name].numpy(),
                                   shards[1].slots[name].numpy(),
                                   rtol=1e-6, atol=1e-7)
    # A sharded checkpoint (slots gathered) has the same keys and values,
    # and restores into the unsharded optimizer.
    shards[0]._gathered = {
        name: tf.concat([s.slots[name] for s in shards], 0)
        for name in shards[0].slot_names}
    view = shards[0].checkpoint_view()
    path = tf.train.Checkpoint(optimizer=view).write(str(tmp_path / "shard"))
    assert checkpoint_keys(path) == checkpoint_keys(written)
    fresh_vars = make_variables()
    fresh = make_optimizer(kind, fresh_vars)
    fresh.build(fresh_vars)
    tf.train.Checkpoint(optimizer=fresh).restore(path).expect_partial()
    for a, b in zip(fresh.variables, optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                   atol=1e-7)
    assert int(fresh.iterations.numpy()) == 2


def test_what_has_no_sharded_update_is_refused():
    for optimizer, named in (
            (keras.optimizers.RMSprop(0.1), "not RMSprop"),
            (keras.optimizers.Adam(0.1, amsgrad=True), "amsgrad"),
            (keras.optimizers.SGD(0.1, global_clipnorm=1.0),
             "global_clipnorm")):
        with pytest.raises(ConfigError, match=named) as e:
            zero.optimizer_kind(optimizer)
        assert e.value.field == "shard_optimizer_state"


# ---- real runs ---------------------------------------------------------------

STEPS = 12
# AdamW without clipping: elementwise, so sharded = unsharded bit for bit at
# 2 workers (with clipping, the global norm is a sum in another order).
ZERO_ARGS = ["--optimizer=adamw", "--clip_global_norm=0",
             "--train_batch_size=24", "--save_checkpoints_steps=6",
             "--log_steps=6", "--deterministic", "--seed=7"]


def zero_args(corpus, out, *extra):
    """BERT-tiny without dropout (another worker count draws other masks)."""
    import json
    from tests.test_pretraining import pretrain_args
    config = out.parent / "no_dropout.json"
    if not config.exists():
        values = json.loads((corpus / "bert_config.json").read_text())
        values.update(hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
        config.write_text(json.dumps(values))
    return pretrain_args(corpus, out, STEPS, *ZERO_ARGS,
                         f"--bert_config_file={config}", *extra)


def key_bias_keys(path) -> set:
    """The checkpoint keys of the attention key biases: their gradient is
    zero in exact arithmetic (softmax does not see a bias shared by a row),
    so what Adam makes of their rounding noise is full-size steps, in any
    other summation order."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(tf.train.load_checkpoint(path).get_tensor(
        "_CHECKPOINTABLE_OBJECT_GRAPH"))
    keys, queue, seen = set(), [(0, ())], set()
    while queue:
        node_id, names = queue.pop(0)
        node = graph.nodes[node_id]
        if names[-3:] == ("attention", "key", "bias"):
            keys.update(a.checkpoint_key for a in node.attributes)
        if node_id in seen:
            continue
        seen.add(node_id)
        queue += [(c.node_id, names + (c.local_name,)) for c in node.children]
    return keys


def checkpoint_state(out, step=STEPS):
    path = str(out / "checkpoints" / f"ckpt-{step}")
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k)
            for k, dtype in reader.get_variable_to_dtype_map().items()
            if dtype != tf.string and not k.startswith(("metrics/",
                                                        "save_counter"))}


def assert_same(a, b):
    """Every weight, slot, RNG state and position bit for bit; the noise
    scale's averages within rounding (its step norms are sums of the
    shards' sums, in another order)."""
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer/_variables/") for k in a)
    for key in a:
        if key.startswith("noise_scale/"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5,
                                       err_msg=key)
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def keep_only(out, step):
    """The run's checkpoints as if it had stopped at `step`."""
    ckpt = out / "checkpoints"
    for name in os.listdir(ckpt):
        if name.startswith("ckpt-") and not name.startswith(f"ckpt-{step}."):
            os.remove(ckpt / name)
    tf.compat.v1.train.update_checkpoint_state(str(ckpt),
                                               str(ckpt / f"ckpt-{step}"))


@pytest.fixture(scope="module")
def unsharded(corpus, tmp_path_factory):
    from tests.test_resume import finish, launch
    out = tmp_path_factory.mktemp("unsharded")
    finish(launch(2, zero_args(corpus, out)))
    return out


@pytest.fixture(scope="module")
def sharded_mpi(corpus, tmp_path_factory):
    from tests.test_resume import finish, launch
    out = tmp_path_factory.mktemp("sharded-mpi")
    finish(launch(2, zero_args(corpus, out, "--shard_optimizer_state",
                               "--backend=mpi")))
    return out


@pytest.mark.slow
def test_sharded_bert_run_ends_where_unsharded_ends(unsharded, sharded_mpi):
    import json
    out = sharded_mpi
    assert_same(checkpoint_state(out), checkpoint_state(unsharded))
    plain = json.loads((unsharded / "summary.json").read_text())
    sharded = json.loads((out / "summary.json").read_text())
    assert sharded["shard_optimizer_state"] and not plain[
        "shard_optimizer_state"]
    assert sharded["optimizer_state_bytes_per_worker"] <= 0.6 * plain[
        "optimizer_state_bytes_per_worker"]
    assert sharded["gradient_bytes_sent_per_step"] <= 1.001 * sharded[
        "all_reduce_bytes_sent_per_step"]
    assert len(sharded["peak_resident_bytes"]) == 2
    assert min(sharded["peak_resident_bytes"]) > 0


@pytest.mark.slow
def test_killed_sharded_run_resumes_on_three_workers(corpus, unsharded,
                                                     tmp_path):
    from tests.test_resume import finish, launch, worker_pid
    out = tmp_path / "killed"
    proc = launch(2, zero_args(corpus, out, "--shard_optimizer_state"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "saved checkpoint" in line and "ckpt-6" in line:
            os.kill(worker_pid(str(out), 1), signal.SIGKILL)
    proc.wait(timeout=120)
    output = "".join(lines)
    assert proc.returncode != 0
    assert "worker 1 failed (killed by SIGKILL)" in output, output[-5000:]
    # The sharded checkpoint is the unsharded run's, bit for bit (gRPC).
    assert_same(checkpoint_state(out, 6), checkpoint_state(unsharded, 6))
    keep_only(out, 6)
    output = finish(launch(3, zero_args(corpus, out,
                                        "--shard_optimizer_state")))
    assert "at step 6; input position restored" in output, output[-5000:]
    resumed, reference = checkpoint_state(out), checkpoint_state(unsharded)
    assert sorted(resumed) == sorted(reference)
    skip = key_bias_keys(str(out / "checkpoints" / f"ckpt-{STEPS}"))
    assert len(skip) == 2  # (BERT-tiny: two layers)
    for key in resumed:
        if key.startswith(("model/", "optimizer/_trainable")) and (
                key not in skip):
            a, b = resumed[key], reference[key]
            # 3 workers sum in another order: within float32 rounding.
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), key


@pytest.mark.slow
def test_an_unsharded_checkpoint_resumes_sharded(corpus, unsharded,
                                                 tmp_path):
    from tests.test_resume import finish, launch
    # The unsharded run's step 6, resumed sharded: its step 12, exactly.
    out = tmp_path / "to-sharded"
    shutil.copytree(unsharded, out)
    keep_only(out, 6)
    finish(launch(2, zero_args(corpus, out, "--shard_optimizer_state")))
    assert_same(checkpoint_state(out), checkpoint_state(unsharded))
    # (A sharded checkpoint restored into the unsharded optimizer:
    # test_checkpoint_is_the_unsharded_layout_both_ways; its keys and
    # values are the unsharded run's, bit for bit, in the tests above.)


def test_backup_and_restore_is_refused_with_the_state_sharded(tmp_path):
    """Keras's BackupAndRestore cannot hold a sharded optimizer's state
    (the moments are in slices across the workers; a restart from its
    backup died in Keras's optimizer build): refused at the start of fit in
    one line naming the field and the way out. (The collectives stand in
    for a second worker: nothing reaches them before the refusal.)"""
    from tfscale.errors import ConfigError
    from tfscale.trainer.loop import TrainConfig, Trainer

    class TwoWorkers:
        name, reduces_metrics, abort = "stand-in", False, None
        num_workers = num_replicas = 2
        worker_index, is_chief = 0, True

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.01)
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=keras.losses.MeanSquaredError(),
                      strategy=strategy, backend=TwoWorkers(),
                      config=TrainConfig(global_batch_size=32, verbose=0,
                                         shard_optimizer_state=True,
                                         fail_fast=False))
    data = tf.data.Dataset.from_tensors(
        (tf.zeros([16, 6]), tf.zeros([16, 1]))).repeat()
    with pytest.raises(ConfigError, match="BackupAndRestore cannot restore "
                       "a run whose optimizer state is sharded") as raised:
        trainer.fit(lambda context: data, steps_per_epoch=2, callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert raised.value.field == "shard_optimizer_state"
    assert "\n" not in str(raised.value)


def test_a_whole_model_checkpoint_is_refused_with_the_state_sharded(
        tmp_path):
    """ModelCheckpoint(save_weights_only=False) under sharded state wrote
    a .keras file without one Adam moment (rc 0, no word), and load_model
    then restarted Adam from zero: refused in one line; the weights-only
    file (the Trainer's checkpoints hold the moments) is fine."""
    from tfscale.errors import ConfigError
    from tfscale.keras import callback_files
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])

    def callbacks(whole):
        return [keras.callbacks.ModelCheckpoint(
            str(tmp_path / ("m.keras" if whole else "m.weights.h5")),
            save_weights_only=not whole)]
    with pytest.raises(ConfigError, match=r"ModelCheckpoint\(save_weights_"
                       r"only=False\) cannot save a model whose optimizer "
                       "state is sharded") as raised:
        callback_files.fit_callbacks(
            callbacks(True), model, None, verbose=0, progress_bar=False,
            epochs=1, steps_per_epoch=1, sharded=True)
    assert "\n" not in str(raised.value)
    for whole, sharded in ((False, True), (True, False)):
        callback_files.fit_callbacks(
            callbacks(whole), model, None, verbose=0, progress_bar=False,
            epochs=1, steps_per_epoch=1, sharded=sharded)
