"""The tf.data service path: a real dispatcher and two real workers (the
processes `python -m input_pipelines.service` runs), the real image
pipelines, two trainers reading one job. The multi-process run
(launch.local starting the service, a service worker killed mid-run) is in
test_images.py."""

import collections
import dataclasses
import os
import socket
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from input_pipelines import images, service, tfrecord
from tests.conftest import run_command

NUM_IDS = 24
SPEC = images.ImageSpec(image_size=16, num_classes=NUM_IDS)


class _Lines:
    """The service's prefixed output, kept (and passed on on failure)."""

    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines.append(text)

    def flush(self):
        pass


@pytest.fixture(scope="module")
def dispatcher(tmp_path_factory):
    """A dispatcher and two workers, processes started as `launch.local
    --data_service_workers 2` starts them; the dispatcher's "host:port".
    (Ended by a signal: an in-process server's stop() waits for its jobs'
    endless training streams, 10-20 s per worker.)"""
    from launch import ports
    from launch.data_service import Service
    from tests.conftest import REPO
    output = _Lines()
    held = ports.lease(1)
    started = Service(2, held.ports[0], output,
                      work_dir=str(tmp_path_factory.mktemp("journal")),
                      env=dict(os.environ, PYTHONPATH=REPO))
    try:
        deadline = time.monotonic() + 120
        while sum("] tf.data service worker of" in line
                  for line in output.lines) < 2:
            assert time.monotonic() < deadline, "".join(output.lines)
            time.sleep(0.1)
        yield started.address
    finally:
        started.stop()
        held.close()


@pytest.fixture(scope="module")
def id_records(tmp_path_factory):
    """4 files of JPEG records whose labels are ids 1..24 (record i: a
    picture of gray level 10 i, label i + 1)."""
    out = tmp_path_factory.mktemp("ids")
    files = []
    for f in range(4):
        name = str(out / f"ids-{f}")
        with tf.io.TFRecordWriter(name) as writer:
            for i in range(f, NUM_IDS, 4):
                pixels = np.full((40, 48, 3), i * 10, np.uint8)
                writer.write(images.serialize_example(
                    tf.io.encode_jpeg(pixels).numpy(), i + 1, 40, 48))
        files.append(name)
    return files


def read_as_trainers(dataset_fn, num_trainers=2, limit=None):
    """Labels the trainers got, reading in turns until each is done (or
    `limit` batches in all)."""
    iterators = [iter(dataset_fn(None)) for _ in range(num_trainers)]
    labels, batches = [], 0
    while iterators and (limit is None or batches < limit):
        for iterator in list(iterators):
            try:
                _, label = next(iterator)
            except StopIteration:
                iterators.remove(iterator)
                continue
            labels += label.numpy().tolist()
            batches += 1
    return collections.Counter(labels)


@pytest.mark.parametrize("mode,copies", [("distributed_epoch", 1),
                                         ("parallel_epochs", 2)])
def test_processing_modes_count_every_record_per_epoch(dispatcher, id_records,
                                                       mode, copies):
    """One epoch of the job, read by two trainers from two service workers:
    distributed_epoch delivers every record once, parallel_epochs once per
    service worker."""
    config = service.ServiceConfig(dispatcher, processing_mode=mode,
                                   job_name=f"epoch-{mode}")
    records = tfrecord.TFRecordConfig(id_records, training=False)
    counts = read_as_trainers(service.ServiceDatasetFn(
        lambda seed: images.make_dataset(records, SPEC, 4), config))
    assert sorted(counts) == list(range(NUM_IDS))
    assert set(counts.values()) == {copies}, counts


@pytest.mark.parametrize("mode", service.PROCESSING_MODES)
def test_training_batches_come_from_the_service(dispatcher, id_records, mode):
    """The training pipeline as the entry points build it, repeating: every
    record comes back epoch after epoch; no position is saved for it.
    (parallel_epochs: each service worker draws its own shuffle seed.)"""
    config = service.ServiceConfig(dispatcher, job_name=f"training-{mode}",
                                   processing_mode=mode)
    records = tfrecord.TFRecordConfig(id_records, training=True, seed=3,
                                      order="sharded", service=config,
                                      shuffle_buffer_size=8)
    dataset_fn = images.make_dataset_fn(records, SPEC, 4)
    assert isinstance(dataset_fn, service.ServiceDatasetFn)
    assert not dataset_fn.resumable
    epochs = 4
    counts = read_as_trainers(dataset_fn, limit=epochs * NUM_IDS // 4)
    assert sorted(counts) == list(range(NUM_IDS))
    # Each worker repeats on its own (a fast one may be epochs ahead of a
    # slow one, and the shuffle buffer spans epoch boundaries); nothing is
    # left out or piles up.
    assert all(1 <= n <= 2 * epochs for n in counts.values()), counts
    batch = next(iter(dataset_fn(None)))
    assert batch[0].shape == (4, 16, 16, 3) and batch[0].dtype == tf.uint8


def test_parallel_epochs_train_at_a_global_seed_of_0(dispatcher, id_records):
    """`--seed=0` seeds the process with 0; each service worker's shuffle
    seed is a tensor (its clock). TensorFlow 2.21 failed to compare them
    with (0, 0); the pipeline now builds and reads every record."""
    keras.utils.set_random_seed(0)
    config = service.ServiceConfig(dispatcher, job_name="seed-0",
                                   processing_mode="parallel_epochs")
    records = tfrecord.TFRecordConfig(id_records, training=True, seed=0,
                                      order="sharded", service=config,
                                      shuffle_buffer_size=8)
    # Each service worker shuffles its own endless stream, and the
    # trainers draw from both in turns: two epochs' worth of batches may
    # miss a record, eight (four from each worker) miss none in practice.
    counts = read_as_trainers(images.make_dataset_fn(records, SPEC, 4),
                              limit=8 * NUM_IDS // 4)
    assert sorted(counts) == list(range(NUM_IDS))


def test_the_global_order_is_refused_with_a_service():
    config = service.ServiceConfig("localhost:5050")
    with pytest.raises(ValueError, match="order 'global' reads records by "
                       "number on each trainer, which a tf.data service "
                       "cannot: use order 'sharded' with data_service"):
        tfrecord.TFRecordConfig("x", service=config)
    for address in ("localhost", "grpc://host:port", ":5050"):
        with pytest.raises(ValueError, match="data_service must be HOST:PORT"):
            service.ServiceConfig(address)
    assert service.ServiceConfig("grpc://h:1").target == "grpc://h:1"
    assert service.job_name_for("/runs/a") == service.job_name_for("/runs/a/")
    assert service.job_name_for("/runs/a") != service.job_name_for("/runs/b")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_dispatcher_fails_within_the_timeout():
    port = closed_port()
    config = service.ServiceConfig(f"localhost:{port}",
                                   connect_timeout_seconds=1.5)
    start = time.monotonic()
    with pytest.raises(service.ServiceError) as raised:
        service.check_reachable(config)
    assert 1.5 <= time.monotonic() - start < 10  # the timeout, not retries
    assert str(raised.value) == (
        f"no tf.data service dispatcher answers at localhost:{port} within "
        "1.5 s (connection refused; --connect_timeout)")


def test_entry_point_names_an_unreachable_dispatcher(id_records, tmp_path):
    port = closed_port()
    start = time.monotonic()
    code, output = run_command(
        [sys.executable, "train_image_classifier.py",
         f"--train_files={id_records[0]}", f"--output_dir={tmp_path}",
         f"--num_classes={NUM_IDS}", "--image_size=16",
         f"--data_service=localhost:{port}", "--connect_timeout=2"],
        timeout=120)
    assert code == 1
    assert output.strip().splitlines()[-1] == (
        "train_image_classifier: error: --data_service: no tf.data service "
        f"dispatcher answers at localhost:{port} within 2 s (connection "
        "refused; --connect_timeout)")
    # TensorFlow's import and the 2 s, not TensorFlow's endless retries.
    assert time.monotonic() - start < 60


def test_a_record_file_the_service_cannot_read_is_named(dispatcher,
                                                         id_records, tmp_path):
    """A file gone on the service's side: the error names the service
    worker and the file. A corrupt file: the trainer's diagnosis names the
    file and the record."""
    gone = str(tmp_path / "gone")
    with open(id_records[0], "rb") as f:
        data = f.read()
    with open(gone, "wb") as f:
        f.write(data)
    config = service.ServiceConfig(dispatcher, job_name="gone")
    records = tfrecord.TFRecordConfig([gone], training=True, seed=1,
                                      order="sharded", service=config)
    dataset = images.make_dataset_fn(records, SPEC, 2)(None)
    os.remove(gone)  # after the trainer listed it
    with pytest.raises(tf.errors.NotFoundError) as raised:
        next(iter(dataset))
    message = service.worker_message(raised.value.message)
    assert message.startswith("tf.data service worker localhost:")
    assert message.endswith(f": {gone}; No such file or directory")

    corrupt = str(tmp_path / "corrupt")
    with open(corrupt, "wb") as f:
        f.write(data[:300] + b"\0" * 40 + data[340:])
    records = dataclasses.replace(records, input_files=[corrupt],
                                  service=dataclasses.replace(
                                      config, job_name="corrupt"))
    with pytest.raises(tf.errors.DataLossError) as raised:
        next(iter(images.make_dataset_fn(records, SPEC, 2)(None)))
    assert "corrupted record at" in raised.value.message
    assert images.find_bad_record([corrupt], SPEC).startswith(
        f"{corrupt}: in records 0-255: corrupted record at")
