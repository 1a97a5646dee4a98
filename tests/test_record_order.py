"""The global record order: the same records in every global batch on any
worker count, every record once per epoch, resume from a global position,
and the offset indexes it reads by. Real TFRecord files, the real pipelines
(`tfrecord.make_dataset`, `images.make_dataset`), one InputContext per
simulated worker."""

import os
import time
import shutil
import threading

import numpy as np
import pytest
import tensorflow as tf

from input_pipelines import dataset_fns, images, record_files, tfrecord
from input_pipelines.record_order import index as record_index
from input_pipelines.record_order import partition, shuffle
from input_pipelines.record_order.reader import RecordReader

WORKER_COUNTS = (1, 2, 3, 4, 6, 8)
ID_SPEC = {"id": tf.io.FixedLenFeature([], tf.int64)}


def write_ids(directory, sizes, start=0):
    """Files of `sizes` records; record i holds id i (file after file)."""
    names, next_id = [], start
    for f, size in enumerate(sizes):
        name = os.path.join(str(directory), f"part-{f:03d}.tfrecord")
        with tf.io.TFRecordWriter(name) as writer:
            for _ in range(size):
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={"id": tf.train.Feature(int64_list=tf.train.
                                                    Int64List(value=[next_id]))}
                )).SerializeToString())
                next_id += 1
        names.append(name)
    return names


def decode_ids(blob, lengths):
    """The ids of the records `RecordReader.read` returned."""
    from input_pipelines.record_order.reader import split_offsets
    starts, sizes = split_offsets(lengths)
    return [tf.train.Example.FromString(blob[b:b + n]).features.feature[
        "id"].int64_list.value[0] for b, n in zip(starts.tolist(),
                                                   sizes.tolist())]


def context(num, index, replicas_per_worker=1):
    return tf.distribute.InputContext(
        num_input_pipelines=num, input_pipeline_id=index,
        num_replicas_in_sync=num * replicas_per_worker)


def global_batches(config, num_workers, steps, global_batch, *,
                   replicas_per_worker=1, accumulation=1, start_position=0):
    """The ids of each optimizer step's global batch, assembled as the
    Trainer's feed hands them out: per micro-batch, each worker's local
    replicas take consecutive per-replica batches."""
    per_replica = global_batch // (num_workers * replicas_per_worker
                                   * accumulation)
    parse = tfrecord.make_parse_fn(ID_SPEC, lambda f: f["id"])
    per_worker = []
    for w in range(num_workers):
        ds = tfrecord.make_dataset(
            config, per_replica, parse,
            context(num_workers, w, replicas_per_worker), start_position)
        count = steps * accumulation * replicas_per_worker
        per_worker.append([b.numpy() for b in ds.take(count)])
    steps_out = []
    for s in range(steps):
        ids = []
        for a in range(accumulation):
            for w in range(num_workers):
                for r in range(replicas_per_worker):
                    micro = (s * accumulation + a) * replicas_per_worker + r
                    ids.extend(per_worker[w][micro].tolist())
        steps_out.append(ids)
    return steps_out


# ---- the order itself (no TensorFlow) -----------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4097])
def test_each_epoch_is_a_permutation_and_epochs_differ(n):
    orders = [shuffle.permute(np.arange(n), n, shuffle.epoch_key(3, e))
              for e in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    if n >= 7:
        assert not np.array_equal(orders[0], orders[1])
        assert not np.array_equal(orders[0], shuffle.permute(
            np.arange(n), n, shuffle.epoch_key(4, 0)))  # another seed
        assert not np.array_equal(orders[0], np.arange(n))


def test_the_permutation_mixes_well():
    n = 100_000
    order = shuffle.permute(np.arange(n), n, shuffle.epoch_key(0, 0))
    # Position and record number are uncorrelated, and neighbours in the
    # order are not neighbours in the files.
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.01
    assert np.median(np.abs(np.diff(order))) > n / 10


def chi_square(counts):
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square's 0.999 quantile for 99 degrees of freedom: a uniform sample
# exceeds it once in a thousand (the keys are fixed: the test is exact).
CHI2_99_0999 = 148.2


@pytest.mark.parametrize("n", [1_281_167, 2 ** 20, 1000])
def test_the_permutation_is_uniform_and_neighbours_independent(n):
    """Over 4,000 epochs (keys), the record at a position is uniform over
    the records (100 bins), and the records at positions 0 and 1 are
    independent (10 x 10 bins): chi-square at realistic sizes (ImageNet's
    1,281,167 records, needing cycle walking; a power of four's square;
    a small set)."""
    positions = np.array([0, 1, n // 2, n - 1])
    samples = np.array([shuffle.permute(positions, n, shuffle.epoch_key(9, e))
                        for e in range(4000)])
    for column in range(len(positions)):
        counts = np.bincount(samples[:, column] * 100 // n, minlength=100)
        assert chi_square(counts) < CHI2_99_0999, (positions[column], counts)
    pairs = (samples[:, 0] * 10 // n) * 10 + samples[:, 1] * 10 // n
    assert chi_square(np.bincount(pairs, minlength=100)) < CHI2_99_0999


@pytest.mark.parametrize("num", WORKER_COUNTS)
def test_pipelines_together_read_each_micro_batch_once(num):
    per = 24 // num
    slices = [partition.Slice(num, p, per) for p in range(num)]
    got = np.sort(np.concatenate([s.positions(0, 5) for s in slices]))
    np.testing.assert_array_equal(got, np.arange(5 * 24))


def test_a_resume_position_must_fit_the_micro_batch():
    assert partition.Slice(3, 0, 8, start_position=48).positions(0, 1)[0] == 48
    with pytest.raises(ValueError, match="input position 20 is not a "
                       "multiple of the global micro-batch 24"):
        partition.Slice(3, 0, 8, start_position=20)


# ---- the pipeline ------------------------------------------------------------

@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """231 records in 7 files of uneven sizes, one of them empty."""
    return write_ids(tmp_path_factory.mktemp("uneven"),
                     [37, 50, 13, 0, 61, 29, 41])


def test_every_worker_count_sees_the_same_global_batches(uneven):
    config = tfrecord.TFRecordConfig(uneven, seed=3, parse_chunk_size=40)
    reference = global_batches(config, 1, 22, 24)  # 2.3 epochs
    for num in WORKER_COUNTS[1:]:  # 8 workers > 7 files (6 non-empty)
        assert global_batches(config, num, 22, 24) == reference, num
    # Replicas per worker and accumulation split the same batch otherwise.
    for num, replicas, accumulation in ((2, 2, 1), (1, 2, 2), (3, 1, 2),
                                        (2, 2, 3)):
        got = global_batches(config, num, 22, 24, accumulation=accumulation,
                             replicas_per_worker=replicas)
        assert [sorted(b) for b in got] == [sorted(b) for b in reference]


def test_every_record_once_per_epoch_and_a_new_order_each_epoch(uneven):
    config = tfrecord.TFRecordConfig(uneven, seed=3)
    ids = [i for batch in global_batches(config, 3, 29, 24) for i in batch]
    first, second, third = ids[:231], ids[231:462], ids[462:693]
    for epoch in (first, second, third):
        assert sorted(epoch) == list(range(231))
    assert first != second and second != third and first != third
    # Mixed across files from the first batch on: 24 records from >= 5 files.
    files = np.searchsorted(np.cumsum([37, 50, 13, 0, 61, 29, 41]),
                            first[:24], side="right")
    assert len(set(files.tolist())) >= 5


def test_a_resumed_pipeline_continues_the_order_on_another_worker_count(
        uneven):
    config = tfrecord.TFRecordConfig(uneven, seed=3)
    reference = global_batches(config, 2, 20, 24)
    for num in (1, 3, 4):
        resumed = global_batches(config, num, 12, 24, start_position=8 * 24)
        assert resumed == reference[8:], num


def test_the_seed_names_the_order(uneven):
    order = [global_batches(tfrecord.TFRecordConfig(uneven, seed=s), 1, 3, 24)
             for s in (3, 3, 4)]
    assert order[0] == order[1] != order[2]


def test_image_crops_are_the_same_on_any_worker_count(tmp_path):
    from input_pipelines import image_folder, pattern_images
    folder = str(tmp_path / "images")
    pattern_images.write_image_folder(folder, 2, 5, seed=2)
    files = image_folder.write_records(image_folder.WriterConfig(
        image_dir=folder, output_dir=str(tmp_path / "records"), num_shards=3,
        seed=1))
    spec = images.ImageSpec(image_size=24, num_classes=2)
    config = tfrecord.TFRecordConfig(files, seed=5)

    def batches(num, steps=4, global_batch=6, start=0):
        out = []
        for w in range(num):
            ds = images.make_dataset(config, spec, global_batch // num,
                                     context(num, w), start_position=start)
            out.append([(x.numpy(), y.numpy()) for x, y in ds.take(steps)])
        return [(np.concatenate([out[w][s][0] for w in range(num)]),
                 np.concatenate([out[w][s][1] for w in range(num)]))
                for s in range(steps)]
    reference = batches(1)
    for num in (2, 3):
        for (x, y), (rx, ry) in zip(batches(num), reference):
            np.testing.assert_array_equal(x, rx)
            np.testing.assert_array_equal(y, ry)
    # A resume at step 2 crops as the uninterrupted run.
    for (x, _), (rx, _) in zip(batches(2, steps=2, start=12), reference[2:]):
        np.testing.assert_array_equal(x, rx)
    # One record, so every position is another epoch: each crops it anew.
    single = str(tmp_path / "single.tfrecord")
    with tf.io.TFRecordWriter(single) as writer:
        writer.write(next(iter(tf.data.TFRecordDataset(files[0]))).numpy())
    crops = next(iter(images.make_dataset(
        tfrecord.TFRecordConfig(single, seed=5), spec, 4)))[0].numpy()
    assert all(not np.array_equal(crops[i], crops[j])
               for i in range(4) for j in range(i + 1, 4))


# ---- indexes and files -----------------------------------------------------------

def test_writers_index_their_shards_and_globs_skip_the_index(tmp_path):
    from input_pipelines import bert_instances
    from input_pipelines.bert_records import BertRecordSpec
    spec = BertRecordSpec(16, 2)
    instance = bert_instances.Instance(
        tokens=[2, 5, 6, 3], segment_ids=[0, 0, 0, 0],
        masked_lm_positions=[1], masked_lm_ids=[5], is_random_next=False)
    from input_pipelines import shard_writer
    names = bert_instances.shard_names(str(tmp_path / "train.tfrecord"), 2)
    for i, name in enumerate(names):
        shard_writer.write_shard(name, bert_instances.serialized(
            [instance] * (3 - i), spec), lambda n: None)
    for name in names:
        saved = record_index.read_saved(name)
        assert saved is not None
        np.testing.assert_array_equal(saved, record_index.scan(name))
    assert len(record_index.read_saved(names[0])) - 1 == 3  # 3 + 2 records
    assert os.path.isdir(tmp_path / ".tfscale-index")
    assert record_files.expand_files(str(tmp_path / "*")) == names


def test_a_stale_or_missing_index_is_rebuilt_and_said(tmp_path, caplog):
    files = write_ids(tmp_path, [5, 6])
    reader = record_files.open_records(files)  # none yet: built now
    assert reader.num_records == 11
    assert "indexed 2 record file(s)" in caplog.text
    # Both files rewritten: file 0 longer, file 1 with the same size (its
    # modification time, later than its index's, says so).
    write_ids(tmp_path, [9, 6], start=100)
    caplog.clear()
    reader = record_files.open_records(files)
    assert reader.num_records == 15
    assert "indexed 2 record file(s)" in caplog.text
    blob, lengths = reader.read(np.array([0, 8, 9, 14]))
    # The new records (ids from 100), read by the rebuilt index.
    assert decode_ids(blob, lengths) == [100, 108, 109, 114]


def test_a_file_changed_under_its_index_is_named(tmp_path):
    files = write_ids(tmp_path, [5, 5])
    offsets = record_index.load(files)
    # Same size, other frames: rewrite file 1 with a different record split.
    data = open(files[1], "rb").read()
    with open(files[1], "r+b") as f:
        f.seek(int(offsets[1][2]))
        f.write(b"\x07" * 8)
    assert len(data) == os.path.getsize(files[1])  # the same size
    reader = RecordReader(files, offsets)
    assert decode_ids(*reader.read(np.array([0, 5, 6]))) == [0, 5, 6]
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"{files[1]}: record 2 does not match"):
        reader.read(np.array([0, 7]))


def test_a_truncated_file_is_named(tmp_path):
    files = write_ids(tmp_path, [5])
    with open(files[0], "r+b") as f:
        f.truncate(os.path.getsize(files[0]) - 7)
    with pytest.raises(record_files.InputError,
                       match=rf"{files[0]}: record 4 at byte \d+ runs past"):
        record_files.open_records(files)


def test_compressed_records_fall_back_to_the_sharded_order(tmp_path):
    name = str(tmp_path / "z.tfrecord")
    with tf.io.TFRecordWriter(name, options="GZIP") as writer:
        for i in range(10):
            writer.write(tf.train.Example(features=tf.train.Features(
                feature={"id": tf.train.Feature(int64_list=tf.train.Int64List(
                    value=[i]))})).SerializeToString())
    config = tfrecord.TFRecordConfig(name, compression_type="GZIP", seed=1)
    assert not tfrecord.uses_global_order(config)
    parse = tfrecord.make_parse_fn(ID_SPEC, lambda f: f["id"])
    ids = [i for b in tfrecord.make_dataset(config, 5, parse).take(4)
           for i in b.numpy().tolist()]
    assert sorted(ids) == sorted(list(range(10)) * 2)


# ---- descriptors and files that change under a run ---------------------------

def test_the_reader_holds_a_bounded_pool_of_descriptors(tmp_path):
    files = write_ids(tmp_path, [3] * 50)
    reader = RecordReader(files, record_index.load(files), max_open_files=8)
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, 150, 16)
        assert decode_ids(*reader.read(ids)) == ids.tolist()
        assert reader.open_files() <= 8
    # A batch may touch more files than the pool holds; it still reads.
    assert decode_ids(*reader.read(np.arange(0, 150, 3))) == list(
        range(0, 150, 3))
    assert reader.open_files() <= 8
    reader.close()
    assert reader.open_files() == 0


def test_a_file_truncated_during_the_run_is_named(tmp_path):
    files = write_ids(tmp_path, [5, 5])
    reader = RecordReader(files, record_index.load(files))
    assert decode_ids(*reader.read(np.array([4, 9]))) == [4, 9]  # both open
    with open(files[1], "r+b") as f:
        f.truncate(os.path.getsize(files[1]) - 7)
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"{files[1]}: has \d+ bytes, \d+ when indexed "
                       r"\(the file was truncated during the run\)"):
        reader.read(np.array([0, 9]))


def test_a_file_replaced_during_the_run_is_refused(tmp_path):
    files = write_ids(tmp_path, [5, 5])
    reader = RecordReader(files, record_index.load(files), max_open_files=1)
    assert decode_ids(*reader.read(np.array([0]))) == [0]
    assert decode_ids(*reader.read(np.array([5]))) == [5]  # file 0 closed
    # Same size, other records, put in place by rename (as writers do).
    (tmp_path / "new").mkdir()
    other = write_ids(tmp_path / "new", [5], start=50)[0]
    os.replace(other, files[0])
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"{files[0]}: is not the file that was "
                             "indexed"):
        reader.read(np.array([1]))
    os.remove(files[1])
    with pytest.raises(OSError, match=rf"{files[1]}: No such file"):
        reader.read(np.array([6]))


def test_a_position_knows_the_order_it_counts_in():
    import json
    from input_pipelines.record_order import identity
    saved = identity.describe(["/d/a", "/d/b"], [10, 20], 3, ["fa", "fb"])
    # Moved to another directory, or renamed and read in the same order:
    # the same records in the same order.
    assert identity.changes(saved, identity.describe(
        ["/e/a", "/e/b"], [10, 20], 3, ["fa", "fb"])) == []
    assert identity.changes(saved, identity.describe(
        ["/d/x", "/d/y"], [10, 20], 3, ["fa", "fb"])) == []
    assert identity.changes(saved, identity.describe(
        ["/d/a"], [10], 3, ["fa"])) == [
        "1 file(s) removed (b)", "records 30 -> 10"]
    assert identity.changes(saved, identity.describe(
        ["/d/a", "/d/b"], [10, 21], 4, ["fa", "fb"])) == [
        "1 file(s) with other record counts (b)", "records 30 -> 31",
        "seed 3 -> 4"]
    # Records rewritten with the same counts.
    assert identity.changes(saved, identity.describe(
        ["/d/a", "/d/b"], [10, 20], 3, ["fa", "fB"])) == [
        "1 file(s) rewritten with the same record counts (b)"]
    # A checkpoint from before fingerprints: names and counts.
    before = json.dumps({"seed": 3, "files": [["a", 10], ["b", 20]]},
                        separators=(",", ":"))
    assert identity.changes(before, saved) == []
    grown = identity.describe(["/d/a", "/d/b", "/d/c"], [10, 20, 5], 3,
                              ["fa", "fb", "fc"])
    # Position 45 is inside epoch 1 of 30 records: the new order (35
    # records) starts at its epoch 2, rounded up to a global batch of 8.
    assert identity.restart_position(saved, 45, grown, 8) == (72, 2)
    assert identity.restart_position(saved, 60, grown, 7) == (70, 2)


def test_records_rewritten_with_the_same_sizes_are_another_order(tmp_path):
    # What a writer rerun with another seed does: every file keeps its
    # size and record count, the records move. A rename of identical files
    # (read in the same order) is no change.
    os.makedirs(tmp_path / "a")
    files = write_ids(tmp_path / "a", [8, 8])
    config = tfrecord.TFRecordConfig(files, seed=1)

    def order_of(config):
        return dataset_fns.make_dataset_fn(config, lambda *a: None)

    saved = order_of(config).order()
    os.makedirs(tmp_path / "new")
    rewritten = write_ids(tmp_path / "new", [8], start=100)[0]
    assert os.path.getsize(rewritten) == os.path.getsize(files[1])
    later = os.stat(record_index.index_path(files[1])).st_mtime_ns + 10**9
    os.utime(rewritten, ns=(later, later))
    os.replace(rewritten, files[1])  # as writers put a shard in place
    position, message = order_of(config).reorder(saved, 12, 4)
    assert "1 file(s) rewritten with the same record counts " \
           "(part-001.tfrecord)" in message
    assert position == 16  # the next epoch of 16 records
    current = order_of(config).order()
    os.makedirs(tmp_path / "renamed")
    for i, name in enumerate(files):
        shutil.copy(name, tmp_path / "renamed" / f"shard-{i}.tfrecord")
    renamed = tfrecord.TFRecordConfig(
        str(tmp_path / "renamed" / "shard-*.tfrecord"), seed=1)
    assert order_of(renamed).reorder(current, 12, 4) == (12, None)


@pytest.mark.parametrize("how", ["mv", "mv_other_sizes", "cp_p"])
def test_records_moved_in_with_an_older_mtime_are_another_order(tmp_path,
                                                               how):
    # Shards staged before the run and moved into place later (`mv`,
    # `rsync -a`, `tar x`) or copied with `cp -p` keep their old mtime:
    # older than the index and fingerprint made for the files they
    # replace. The resume must see other records, not continue at q.
    # (Mutation tried: freshness by mtime, as before: position 12, None.)
    os.makedirs(tmp_path / "staged")
    start = 1000 if how == "mv_other_sizes" else 100  # longer varints
    staged = write_ids(tmp_path / "staged", [8, 8], start=start)
    os.makedirs(tmp_path / "a")
    files = write_ids(tmp_path / "a", [8, 8])
    config = tfrecord.TFRecordConfig(files, seed=1)

    def order_of(config):
        return dataset_fns.make_dataset_fn(config, lambda *a: None)

    saved = order_of(config).order()  # indexed and fingerprinted now
    earlier = os.stat(files[0]).st_mtime_ns - 10**9
    for name in staged:
        os.utime(name, ns=(earlier, earlier))
    for source, target in zip(staged, files):
        if how == "cp_p":
            shutil.copy2(source, target)  # same inode, the old mtime
        else:
            os.replace(source, target)
        assert os.stat(target).st_mtime_ns < os.stat(
            record_index.index_path(target)).st_mtime_ns
    position, message = order_of(config).reorder(saved, 12, 4)
    assert position == 16, message
    assert "2 file(s) rewritten with the same record counts" in message
    offsets = record_index.load(files)
    reader = RecordReader(files, offsets)
    assert decode_ids(*reader.read(np.array([0, 15]))) == [start,
                                                            start + 15]


def test_a_positioned_input_with_another_batch_size_is_refused(tmp_path):
    from tests.test_trainer import make_trainer, mirrored, TWO_CPUS
    from tfscale.trainer.loop import TrainConfig
    files = write_ids(tmp_path, [40, 40])
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=8))
    parse = tfrecord.make_parse_fn(ID_SPEC, lambda f: (
        tf.cast(tf.stack([f["id"]] * 6, 1), tf.float32),
        tf.cast(f["id"][:, None], tf.float32)))
    config = tfrecord.TFRecordConfig(files, seed=1)
    for batch, fails in ((4, False), (8, True)):
        dataset_fn = dataset_fns.make_dataset_fn(
            config, lambda c, context, start, b=batch: tfrecord.make_dataset(
                c, b, parse, context, start))
        if fails:
            with pytest.raises(ValueError, match="the input's batches hold 8 "
                               "examples per replica, the Trainer's 4"):
                trainer.fit(dataset_fn, steps_per_epoch=2)
        else:
            trainer.fit(dataset_fn, steps_per_epoch=2)


def open_descriptors(names):
    """This process's descriptors open on `names`."""
    names, found = set(names), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") in names
        except OSError:
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_pipelines_rebuilt_in_one_process_stay_within_the_descriptors(
        tmp_path):
    # 100 record files, a soft limit of 512 descriptors: each rebuilt
    # pipeline's reader held up to 64 descriptors for good (its read
    # function's graph outlives the pipeline), and the 8th rebuild failed
    # with "Too many open files". The process's readers now share one
    # budget; readers nobody reads give theirs back. (Mutation tried: no
    # shared budget: "Too many open files" again.)
    import resource
    from input_pipelines.record_order import reader as reader_lib
    files = write_ids(tmp_path, [3] * 100)
    config = tfrecord.TFRecordConfig(files, seed=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # 512 above what this process holds (the whole suite's process holds
    # hundreds): ten pipelines of 100 files would need 1,000.
    limit = len(os.listdir("/proc/self/fd")) + 512
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        budget = reader_lib.process_budget()
        assert budget == (min(limit, hard) - 256) // 2
        held = []
        for _ in range(10):
            iterator = iter(tfrecord.make_dataset(config, 4, lambda x: x))
            ids = [int(i) for _ in range(75)
                   for i in tf.io.parse_example(next(iterator), ID_SPEC)[
                       "id"].numpy()]
            assert sorted(ids) == list(range(300))  # every file read
            del iterator
            held.append(open_descriptors(files))
        assert max(held) <= budget, held
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class CountingOs:
    """`os` for the reader module, counting its descriptors of `names`."""

    def __init__(self, names):
        self._names = set(names)
        self._mine = set()
        self._lock = threading.Lock()
        self.now = self.most = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, *args):
        fd = os.open(path, *args)
        if path in self._names:
            with self._lock:
                self._mine.add(fd)
                self.now += 1
                self.most = max(self.most, self.now)
        return fd

    def close(self, fd):
        with self._lock:
            if fd in self._mine:
                self._mine.discard(fd)
                self.now -= 1
        os.close(fd)


def test_the_pool_keeps_its_bound_under_parallel_readers(tmp_path,
                                                         monkeypatch):
    from concurrent.futures import ThreadPoolExecutor
    from input_pipelines.record_order import reader as reader_module
    files = write_ids(tmp_path, [20] * 12)
    counting = CountingOs(files)
    monkeypatch.setattr(reader_module, "os", counting)
    reader = RecordReader(files, record_index.load(files), max_open_files=4)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 240, 16) for _ in range(400)]
    with ThreadPoolExecutor(8) as pool:
        read = list(pool.map(lambda ids: decode_ids(*reader.read(ids)),
                             batches))
    assert read == [ids.tolist() for ids in batches]
    assert counting.most <= 4
    # close() waits for reads in flight instead of closing under them.
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(lambda ids: decode_ids(*reader.read(ids)), b)
                   for b in batches[:200]]
        reader.close()
        assert [f.result() for f in futures] == [
            b.tolist() for b in batches[:200]]
    reader.close()
    assert counting.now == 0


def test_a_file_modified_after_its_index_is_refused(tmp_path):
    files = write_ids(tmp_path, [5, 5])
    reader = RecordReader(files, record_index.load(files))
    earlier = os.stat(files[1]).st_mtime_ns - 10**9
    os.utime(files[1], ns=(earlier, earlier))  # touched, even to the past
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"{files[1]}: is not the file that was indexed"):
        reader.read(np.array([7]))


def test_a_chmod_or_a_hard_link_during_the_run_is_not_a_rewrite(tmp_path):
    """Metadata that moves only the ctime (chmod, a `cp -al` snapshot's
    hard link) with the content as indexed: the run reads on. (Three of
    three such runs stopped: "replaced or rewritten during the run".)"""
    files = write_ids(tmp_path, [5, 5])
    offsets = record_index.load(files)
    record_index.fingerprints(files, offsets)  # what the run's order saves
    reader = RecordReader(files, offsets, max_open_files=1)
    assert decode_ids(*reader.read(np.array([0]))) == [0]
    os.chmod(files[0], 0o600)
    (tmp_path / "snapshot").mkdir()
    os.link(files[1], tmp_path / "snapshot" / "ids-1")
    for _ in range(2):  # each read reopens the other file
        assert decode_ids(*reader.read(np.array([5, 1]))) == [5, 1]


def test_metadata_changes_to_one_file_any_number_of_times_are_no_rewrite(
        tmp_path):
    """A chmod, then a hard link, then a chmod again of the same files, on
    records indexed ahead of time whose digests could not be saved (a
    read-only mount: the saved ones are gone once the reader is made). A
    run passed the chmod and stopped at the hard link ("is not the file
    that was indexed"), and a read-only copy stopped at the first chmod."""
    files = write_ids(tmp_path, [5, 5])
    for name in files:
        record_index.write(name)  # index_records' and the writers' work
    offsets = record_index.load(files)
    reader = RecordReader(files, offsets, max_open_files=1)
    for name in files:
        os.remove(record_index.fingerprint_path(name))
    (tmp_path / "snapshot").mkdir()
    changes = [lambda n: os.chmod(n, 0o600),
               lambda n: os.link(n, tmp_path / "snapshot" /
                                 (os.path.basename(n) + ".1")),
               lambda n: os.chmod(n, 0o644),
               lambda n: os.link(n, tmp_path / "snapshot" /
                                 (os.path.basename(n) + ".2"))]
    for change in changes:
        for name in files:
            change(name)
        for _ in range(2):  # each read reopens the other file
            assert decode_ids(*reader.read(np.array([5, 1]))) == [5, 1]


def test_a_rewrite_that_sets_the_mtime_back_is_still_refused(tmp_path):
    """Same inode, same size, the mtime set back (`touch -r`): only the
    ctime says so, and the content differs."""
    files = write_ids(tmp_path, [5, 5])
    offsets = record_index.load(files)
    record_index.fingerprints(files, offsets)
    reader = RecordReader(files, offsets, max_open_files=1)
    assert decode_ids(*reader.read(np.array([5]))) == [5]
    before = os.stat(files[0])
    (tmp_path / "other").mkdir()
    other = write_ids(tmp_path / "other", [5], start=50)[0]
    with open(other, "rb") as src, open(files[0], "r+b") as dst:
        dst.write(src.read())  # in place: same inode, same size
    os.utime(files[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"{files[0]}: is not the file that was "
                             "indexed"):
        reader.read(np.array([1]))


def flip_byte(path, record, offsets, at=-5):
    """One byte of record `record`'s payload changed (`at` from its frame's
    end, before the CRC), the CRC left as it was."""
    start, end = int(offsets[record]), int(offsets[record + 1])
    with open(path, "r+b") as f:
        f.seek(end + at)
        byte = f.read(1)
        f.seek(end + at)
        f.write(bytes([byte[0] ^ 0x01]))
    assert start < end + at < end - 4


def test_a_record_whose_bytes_changed_is_named_by_its_crc(tmp_path):
    """One byte of one id flipped, its CRC stale (the index, built before,
    still matches the lengths): named by file and record, as TensorFlow's
    reader does; with verify_records off, read as it is (mutation tried:
    the CRC check removed -> the ids come back, one of them wrong)."""
    files = write_ids(tmp_path, [6, 6])
    offsets = record_index.load(files)
    flip_byte(files[1], 3, offsets[1])
    reader = RecordReader(files, offsets)
    assert decode_ids(*reader.read(np.array([0, 5, 6, 8]))) == [0, 5, 6, 8]
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"^{files[1]}: record 3 is corrupt: its "
                             r"CRC-32C does not match its bytes \(stored "):
        reader.read(np.array([1, 9, 2]))
    with pytest.raises(tf.errors.DataLossError, match="corrupted record"):
        list(tf.data.TFRecordDataset(files[1]))
    unchecked = RecordReader(files, offsets, verify_records=False)
    assert decode_ids(*unchecked.read(np.array([9]))) != [9]


def test_masked_crcs_are_tensorflows():
    from input_pipelines.record_order.crc import masked_crc32c
    import struct
    import tempfile
    records = [b"", b"a", b"tfscale" * 100]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "r.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in records:
                writer.write(r)
        data = open(path, "rb").read()
    stored, at = [], 0
    for r in records:
        at += 12 + len(r)
        stored.append(struct.unpack("<I", data[at:at + 4])[0])
        at += 4
    assert masked_crc32c(records).tolist() == stored


def test_a_file_rewritten_in_place_under_an_open_reader_is_refused(tmp_path):
    """The file stays open between reads (a pool of 2): a rewrite in place
    (the same records in another order, the same lengths: every length and
    CRC still valid) is caught at the next read, naming the file. Before:
    1,052 of 3,000 batches differed from a clean read, with no error
    (mutation tried: the fstat check removed -> the new order is read)."""
    files = write_ids(tmp_path, [5, 5])
    reader = RecordReader(files, record_index.load(files), max_open_files=2)
    assert decode_ids(*reader.read(np.array([5, 6]))) == [5, 6]
    with open(files[1], "rb") as f:
        data = f.read()
    offsets = record_index.load(files)[1]
    frames = [data[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]
    time.sleep(0.01)
    with open(files[1], "r+b") as f:  # in place: the same inode and size
        f.write(b"".join(reversed(frames)))
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"^{files[1]}: was rewritten in place during "
                             "the run"):
        reader.read(np.array([7]))


def test_garbage_in_a_text_field_is_named_by_its_crc(tmp_path):
    """16 garbage bytes over a record's text feature (before: a
    UnicodeDecodeError naming no file or record, exit 1, restarted)."""
    name = str(tmp_path / "text-00000-of-00001.tfrecord")
    with tf.io.TFRecordWriter(name) as writer:
        for i in range(4):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "image/class/text": tf.train.Feature(bytes_list=tf.train.
                                                     BytesList(value=[
                                                         b"tabby cat %d" % i
                                                         * 4]))})
            ).SerializeToString())
    offsets = record_index.load([name])
    with open(name, "r+b") as f:
        data = bytearray(f.read())
        at = data.index(b"tabby cat 2")
        data[at:at + 16] = b"\xf5" * 16
        f.seek(0)
        f.write(data)
    reader = RecordReader([name], offsets)
    with pytest.raises(record_index.RecordIndexError,
                       match=rf"^{name}: record 2 is corrupt: its CRC-32C"):
        reader.read(np.array([0, 2]))
