"""The record writers on a real Dask cluster: a `dask scheduler` and two
`dask worker` processes on 127.0.0.1 (no nanny: a killed worker stays dead).

- A worker killed with SIGKILL mid-task: the job still finishes, and every
  shard and index is byte-identical to a one-process run; no temporary file
  is left.
- The client killed mid-job: the rerun keeps the complete shards, writes the
  missing ones, and the bytes are the one-process run's.
- A bad image fails the job naming the image, the shard and the worker.
- The indexer's tasks run on the same workers.
- A failed task stops the running ones (their temporary files gone when
  the job ends); a task that kills its worker ends in one line naming the
  memory limit (a LocalCluster).

And the BERT writer's stages on their own: documents of every input file
(plain or gzip) in every bucket, by a stable hash; bytes that are not UTF-8
named; pieces cut at documents with the bytes of one read; a shard streamed
through spill files with Google's in-memory order when it fits in one.
"""

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from input_pipelines import pattern_images
from tests.conftest import REPO, run_command

DASK = os.path.join(os.path.dirname(sys.executable), "dask")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def dask_cluster(tmp_path):
    """(scheduler file, [worker processes])."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    scheduler_file = tmp_path / "scheduler.json"
    log = open(tmp_path / "dask.log", "w")
    processes = [subprocess.Popen(
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
         "--no-dashboard", "--scheduler-file", str(scheduler_file)],
        env=env, stdout=log, stderr=subprocess.STDOUT)]
    try:
        wait_for(scheduler_file.exists, 60, "the scheduler")
        workers = [subprocess.Popen(
            [DASK, "worker", "--scheduler-file", str(scheduler_file),
             "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host",
             "127.0.0.1", "--name", f"w{i}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            for i in range(2)]
        processes += workers

        def both_joined():
            text = (tmp_path / "dask.log").read_text()
            return text.count("Starting established connection") >= 2
        wait_for(both_joined, 90, "two workers")
        yield str(scheduler_file), workers
    finally:
        for process in processes:
            process.kill()
            process.wait()
        log.close()


def open_files(pid):
    """The paths process `pid` holds open (Linux /proc)."""
    folder = f"/proc/{pid}/fd"
    paths = []
    try:
        for fd in os.listdir(folder):
            try:
                paths.append(os.readlink(os.path.join(folder, fd)))
            except OSError:
                pass
    except OSError:
        pass
    return paths


def digests(folder):
    """{relative path: sha256} of every file, index files included (their
    offsets, and the fingerprints' content digests: the stamp beside them
    names this copy's inode and times)."""
    import numpy as np
    result = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".index.npz"):
                with np.load(path) as index:
                    data = index["offsets"].tobytes()
            elif name.endswith(".fingerprint"):
                with open(path) as f:  # "STAMP DIGEST": the content's digest
                    data = f.read().split()[-1].encode()
            else:
                with open(path, "rb") as f:
                    data = f.read()
            result[os.path.relpath(path, folder)] = hashlib.sha256(
                data).hexdigest()
    return result


def temporary_files(folder):
    return [os.path.join(root, name) for root, _, files in os.walk(folder)
            for name in files
            if name.endswith((".incomplete", ".partial"))]


def build_images(image_dir, out, *extra, wait=True):
    command = [sys.executable, "-m", "input_pipelines.build_image_records",
               f"--image_dir={image_dir}", f"--output_dir={out}",
               "--num_shards=8", "--noprogress", *extra]
    if wait:
        return run_command(command, timeout=300)
    return subprocess.Popen(command, cwd=REPO, env=dict(
        os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_image_writer_survives_a_killed_worker_with_identical_bytes(
        dask_cluster, tmp_path):
    scheduler_file, workers = dask_cluster
    image_dir = str(tmp_path / "images")
    pattern_images.write_image_folder(image_dir, 3, 24, seed=2)
    code, output = build_images(image_dir, tmp_path / "one",
                                "--num_processes=1")
    assert code == 0, output
    reference = digests(tmp_path / "one")
    assert len([n for n in reference if n.startswith("train-")]) == 8

    out = tmp_path / "dask"
    job = build_images(image_dir, out, f"--scheduler_file={scheduler_file}",
                       wait=False)
    # Kill the worker that holds a shard's temporary file open: mid-task.
    victim = []

    def writing_worker():
        for worker in workers:
            if any(t.endswith(".incomplete") for t in open_files(worker.pid)):
                victim.append(worker)
                return True
        return False
    wait_for(writing_worker, 120, "a worker writing a shard")
    victim[0].send_signal(signal.SIGKILL)
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output
    assert victim[0].wait() == -signal.SIGKILL
    # Its attempt's file was left behind, then removed by the client.
    assert re.search(r"removed [1-9]\d* temporary file", output), output
    assert digests(out) == reference
    assert temporary_files(out) == []
    # The indexer on the same workers: every index rebuilt, the same bytes.
    for index in (out / ".tfscale-index").iterdir():
        index.unlink()
    code, output = run_command(
        [sys.executable, "-m", "input_pipelines.index_records",
         f"--scheduler_file={scheduler_file}", str(out / "train-*")],
        timeout=300)
    assert code == 0, output
    assert "index_records: 8 files" in output and "8 indexed now" in output
    assert digests(out) == reference

    # A bad image: the job fails naming it, its shard and the worker.
    bad = os.path.join(image_dir, "class_000", "broken.jpg")
    with open(bad, "wb") as f:
        f.write(b"not a JPEG")
    code, output = build_images(image_dir, tmp_path / "bad",
                                f"--scheduler_file={scheduler_file}")
    assert code != 0
    line = output.strip().splitlines()[-1]
    assert line.startswith("build_image_records: error: "), output[-2000:]
    assert "broken.jpg" in line and "on dask worker tcp://127.0.0.1:" in line
    assert temporary_files(tmp_path / "bad") == []


@pytest.mark.slow
def test_two_clients_with_the_same_shard_names_each_run_their_own_tasks(
        dask_cluster, tmp_path):
    # The engine itself, two clients at once on one scheduler, tasks that
    # take half a second each: every task of both runs while the other
    # job's are submitted or running.
    import threading

    from input_pipelines.prepare import engine
    from tests.workers import slow_shard
    scheduler_file, _ = dask_cluster
    names = [f"train-{i:05d}-of-00006" for i in range(6)]
    config = engine.EngineConfig(scheduler_file=scheduler_file)
    start = threading.Barrier(2)
    results = {}

    def job(folder):
        folder.mkdir()
        tasks = [(str(folder), name) for name in names]
        start.wait()
        results[folder.name] = engine.run(
            tasks, slow_shard.write, config=config, work=[1] * len(tasks),
            work_per_process=1, describe=lambda task: task[1])

    threads = [threading.Thread(target=job, args=(tmp_path / folder,))
               for folder in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {"a": names, "b": names}
    for folder in ("a", "b"):
        assert sorted(os.listdir(tmp_path / folder)) == names
        for name in names:
            assert (tmp_path / folder / name).read_text() == (
                f"{tmp_path / folder}/{name}")


def test_a_scheduler_whose_workers_all_died_ends_the_job_in_one_line(
        dask_cluster, tmp_path, monkeypatch):
    # Workers without a nanny (the shipped SLURM template's before) that
    # die for good (OOM): the client waited with 0 workers until the job's
    # time limit. Now it ends after NO_WORKERS_SECONDS with one line.
    # (Mutation tried: the wait without the worker count: the job hung.)
    from input_pipelines.prepare import engine
    from tests.workers import slow_shard
    monkeypatch.setattr(engine, "NO_WORKERS_SECONDS", 3.0)
    monkeypatch.setattr(engine, "WATCH_SECONDS", 0.5)
    scheduler_file, workers = dask_cluster
    tasks = [(str(tmp_path), f"s-{i}") for i in range(40)]

    def kill_workers():
        wait_for(lambda: any(n.startswith("s-") for n in os.listdir(
            tmp_path)), 60, "a first task")
        for worker in workers:
            worker.send_signal(signal.SIGKILL)
    import threading
    killer = threading.Thread(target=kill_workers)
    killer.start()
    start = time.monotonic()
    with pytest.raises(engine.TaskError) as error:
        engine.run(tasks, slow_shard.write, config=engine.EngineConfig(
            scheduler_file=scheduler_file), work=[1] * len(tasks),
            work_per_process=1, describe=lambda task: task[1])
    killer.join()
    assert time.monotonic() - start < 60
    message = str(error.value)
    assert "\n" not in message
    assert re.match(r"the Dask scheduler has had no worker for 3 s with "
                    r"\d+ task\(s\) to run: its workers died \(out of "
                    r"memory\? the workers' memory limit", message), message


@pytest.mark.slow
def test_bert_writer_rerun_after_the_client_died_writes_the_same_bytes(
        dask_cluster, corpus, tmp_path):  # noqa: F811
    scheduler_file, _ = dask_cluster

    def command(out, *extra):
        return [sys.executable, "-m", "input_pipelines.create_pretraining_data",
                f"--input_file={corpus}/corpus.txt",
                f"--vocab_file={corpus}/vocab.txt",
                f"--output_file={out}/train.tfrecord",
                "--num_output_shards=8", "--max_seq_length=32",
                "--max_predictions_per_seq=5", "--dupe_factor=3",
                "--noprogress", *extra]
    code, output = run_command(command(tmp_path / "one", "--num_processes=1"),
                               timeout=300)
    assert code == 0, output
    reference = digests(tmp_path / "one")

    out = tmp_path / "dask"
    client = subprocess.Popen(
        command(out, f"--scheduler_file={scheduler_file}"), cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    index = out / ".tfscale-index"
    wait_for(lambda: index.exists() and len(os.listdir(index)) >= 1, 180,
             "a first complete shard")
    client.send_signal(signal.SIGKILL)
    client.wait()
    done_before = len([n for n in os.listdir(index) if n.endswith(".index.npz")])
    code, output = run_command(
        command(out, f"--scheduler_file={scheduler_file}"), timeout=300)
    assert code == 0, output
    if done_before < 8:
        assert "kept" in output and "complete shards of an earlier run" in (
            output), output
    # (Tasks the dead client had submitted may have finished meanwhile:
    # they wrote the same bytes.)
    assert digests(out) == reference
    assert temporary_files(out) == []


def bert_writer(corpus, out, *extra):
    return [sys.executable, "-m", "input_pipelines.create_pretraining_data",
            f"--input_file={corpus}/corpus.txt",
            f"--vocab_file={corpus}/vocab.txt",
            f"--output_file={out}/train.tfrecord", "--max_seq_length=32",
            "--max_predictions_per_seq=5", "--noprogress", *extra]


@pytest.mark.slow
def test_a_rerun_with_other_settings_killed_and_rerun_never_mixes_plans(
        dask_cluster, corpus, tmp_path):  # noqa: F811
    # Plan 1 writes 8 shards; plan 2 (another --dupe_factor) is killed after
    # its first shards; its rerun ends with plan 2's bytes in every shard
    # (plan 1's were removed when plan 2 began, not kept as "complete").
    scheduler_file, _ = dask_cluster
    plan2 = ("--num_output_shards=8", "--dupe_factor=3")
    code, output = run_command(bert_writer(corpus, tmp_path / "one", *plan2,
                                           "--num_processes=1"), timeout=300)
    assert code == 0, output
    reference = digests(tmp_path / "one")
    out = tmp_path / "out"
    code, output = run_command(bert_writer(
        corpus, out, "--num_output_shards=8", "--dupe_factor=2",
        "--num_processes=1"), timeout=300)
    assert code == 0, output
    manifest = out / ".train.manifest.json"
    first = manifest.read_text()
    client = subprocess.Popen(
        bert_writer(corpus, out, *plan2, f"--scheduler_file={scheduler_file}"),
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = out / ".tfscale-index"

    def new_shards():
        if manifest.read_text() == first:
            return 0
        since = manifest.stat().st_mtime
        return sum(1 for n in os.listdir(index)
                   if (index / n).stat().st_mtime > since)
    wait_for(lambda: new_shards() >= 1, 180, "plan 2's first shard")
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert new_shards() < 8  # killed mid-job
    code, output = run_command(bert_writer(
        corpus, out, *plan2, f"--scheduler_file={scheduler_file}"),
        timeout=300)
    assert code == 0, output
    assert digests(out) == reference


def test_the_bert_writer_refuses_shards_of_another_count(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    code, output = run_command(bert_writer(
        corpus, out, "--num_output_shards=2", "--num_processes=1"))
    assert code == 0, output
    code, output = run_command(bert_writer(
        corpus, out, "--num_output_shards=3", "--num_processes=1"))
    assert code != 0
    assert output.strip().splitlines()[-1] == (
        "create_pretraining_data: error: --num_output_shards=3: "
        f"{out} already holds {out}/train-00000-of-00002.tfrecord (2 files "
        "of another shard count, which a glob of the shards would read "
        "too); remove them or choose another --output_file")


def test_buckets_mix_documents_of_every_file_stably(tmp_path):
    from input_pipelines.prepare import buckets
    files = []
    for i in range(2):
        text = "".join(f"file {i} document {d} first.\nsecond line.\n\n"
                       for d in range(40))
        path = tmp_path / f"corpus-{i}.txt"
        if i == 1:
            path = tmp_path / "corpus-1.txt.gz"
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            path.write_text(text)
        files.append(str(path))
    work = tmp_path / "work"
    work.mkdir()
    parts = [buckets.split_file(buckets.SplitTask(f, i, 4, 7, str(work)),
                                lambda n: None) for i, f in enumerate(files)]
    assert sum(sum(p["documents"]) for p in parts) == 80
    sources = set()
    for bucket in range(4):
        documents = list(buckets.read_bucket(
            str(work), buckets.bucket_ranges(parts, bucket)))
        sources |= {(bucket, d[0].split()[1]) for d in documents}
        assert all(len(d) == 2 for d in documents)
    # Every bucket holds documents of both files.
    assert sources == {(b, f) for b in range(4) for f in ("0", "1")}
    # Stable: the same bucket in another process and Python (no salted hash).
    code = ("from input_pipelines.prepare.buckets import bucket_of; "
            "print(bucket_of(7, ['a b', 'c'], 1000))")
    outputs = {run_command([sys.executable, "-c", code],
                           env={"PYTHONHASHSEED": seed})[1].strip()
               for seed in ("1", "2")}
    assert outputs == {str(buckets.bucket_of(7, ["a b", "c"], 1000))}
    # A part is written once: a second call keeps it.
    before = os.stat(buckets.part_paths(str(work), 0)[0]).st_mtime_ns
    buckets.split_file(buckets.SplitTask(files[0], 0, 4, 7, str(work)),
                       lambda n: None)
    assert os.stat(buckets.part_paths(str(work), 0)[0]).st_mtime_ns == before
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\nsecond \xff\xfe line\n")
    with pytest.raises(ValueError, match=r"bad.txt: line 3 \(byte 18\) is "
                                         "not UTF-8"):
        buckets.split_file(buckets.SplitTask(str(bad), 2, 4, 7, str(work)),
                           lambda n: None)


@pytest.mark.slow
def test_a_failed_task_stops_the_running_ones_and_leaves_no_temporary_file(
        tmp_path):
    # A real LocalCluster of two processes: one task fails after 1 s while
    # the other is writing a 20 s shard. When `run` raises, the writer has
    # already stopped (told by the job's event; it says how it ended) and
    # its temporary file is gone: nothing is still writing into the folder.
    from input_pipelines.prepare import engine
    from tests.workers import engine_tasks
    tasks = [("write", str(tmp_path), "train-00000-of-00002"),
             ("fail", str(tmp_path), "train-00001-of-00002")]
    with pytest.raises(ValueError, match=r"train-00001-of-00002: broken "
                                         r"input \(task train-00001"):
        engine.run(tasks, engine_tasks.run,
                   config=engine.EngineConfig(processes=2), work=[1, 1],
                   work_per_process=1, describe=lambda t: t[2])
    assert (tmp_path / "train-00000-of-00002.ended").read_text() == "raised"
    assert sorted(os.listdir(tmp_path)) == ["train-00000-of-00002.ended"]


@pytest.mark.slow
def test_a_task_that_kills_its_worker_ends_in_one_line_naming_memory(
        tmp_path):
    import dask

    from input_pipelines.prepare import engine
    from tests.workers import engine_tasks
    task = ("hog", str(tmp_path), "/data/corpus-00007.txt")
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        with pytest.raises(engine.TaskError) as raised:
            engine.run([task, task], engine_tasks.run,
                       config=engine.EngineConfig(
                           processes=2, worker_memory="400MB"),
                       work=[1, 1], work_per_process=1,
                       describe=lambda t: t[2])
    assert str(raised.value) == (
        "task /data/corpus-00007.txt: the 2 workers that ran it died (out "
        "of memory, or killed): --worker_memory=400MB; give the workers "
        "more memory or write smaller pieces")


def test_the_bert_writer_checks_its_memory_flags(corpus, tmp_path):  # noqa: F811
    for flag, line in (
            ("--worker_memory=lots", "--worker_memory=lots: not a size "
             "(e.g. 2GB, 512MiB) or auto"),
            ("--piece_mb=0", "--piece_mb must be >= 1")):
        code, output = run_command(bert_writer(corpus, tmp_path, flag))
        assert code != 0
        assert output.strip().splitlines()[-1] == (
            f"create_pretraining_data: error: {line}")


def test_stage_one_reads_pieces_cut_at_documents_with_the_same_bytes(
        tmp_path):
    from input_pipelines.prepare import buckets
    text = "".join(f"document {d} first.\n{'word ' * (d % 7)}second.\n\n"
                   for d in range(300))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    pieces = list(buckets.read_pieces(str(path), 500))
    assert len(pieces) > 10
    assert all(piece[-1] == "" for piece in pieces[:-1])  # cut at a blank
    assert [line for p in pieces for line in p] == text.splitlines()
    parts = {}
    for piece_bytes in (200, buckets.PIECE_BYTES):
        work = tmp_path / f"work-{piece_bytes}"
        work.mkdir()
        parts[piece_bytes] = buckets.split_file(buckets.SplitTask(
            str(path), 0, 5, 3, str(work), piece_bytes), lambda n: None)
        assert sorted(os.listdir(work)) == ["part-00000.json",
                                            "part-00000.txt"]
        documents = [d for b in range(5) for d in buckets.read_bucket(
            str(work), buckets.bucket_ranges([parts[piece_bytes]], b), 64)]
        assert sorted(documents) == sorted(buckets.read_documents(
            text.splitlines()))
    assert parts[200] == parts[buckets.PIECE_BYTES]
    assert digests(tmp_path / "work-200") == digests(
        tmp_path / f"work-{buckets.PIECE_BYTES}")


def test_stage_two_streams_google_order_and_shuffles_through_spills(
        corpus, tmp_path, monkeypatch):  # noqa: F811
    # The streamed shard (documents in a file of ids, instances shuffled
    # through spill files) against Google's in-memory order: the same bytes
    # with one spill; with many, the same records in another order, the
    # same for every piece size.
    import random

    import tensorflow as tf

    from input_pipelines import bert_instances as bi
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.prepare import buckets
    work = tmp_path / "work"
    work.mkdir()
    part = buckets.split_file(buckets.SplitTask(
        f"{corpus}/corpus.txt", 0, 1, 1, str(work)), lambda n: None)
    vocab = bi.load_vocab(f"{corpus}/vocab.txt")
    ids = bi.SpecialIds(vocab.index("[CLS]"), vocab.index("[SEP]"),
                        vocab.index("[MASK]"), len(vocab))
    config = bi.InstanceConfig(32, 5, 0.15, 0.1, 2)
    spec = BertRecordSpec(32, 5)

    def streamed(name, piece_bytes=buckets.PIECE_BYTES):
        task = bi.ShardTask(str(tmp_path / name), str(work),
                            tuple(buckets.bucket_ranges([part], 0)),
                            f"{corpus}/vocab.txt", True, config, ids, "7",
                            spec, piece_bytes)
        bi.write_instance_shard(task, lambda n: None)
        return [r.numpy() for r in tf.data.TFRecordDataset(task.name)]

    documents = list(buckets.read_bucket(str(work), [(0, *part["ranges"][0])]))
    tokens = iter(bi.tokenize([s for d in documents for s in d],
                              f"{corpus}/vocab.txt"))
    google = list(bi.serialized(bi.create_instances(
        [[t for t in (next(tokens) for _ in d) if t] for d in documents],
        config, ids, random.Random("7")), spec))
    assert streamed("one-spill") == google
    monkeypatch.setattr(bi, "SPILL_BYTES", 20_000)
    monkeypatch.setattr(bi, "_BUFFER_BYTES", 5_000)
    spilled = streamed("spills")
    assert spilled != google and sorted(spilled) == sorted(google)
    assert streamed("small-pieces", piece_bytes=100) == spilled
    assert sorted(os.listdir(work)) == ["part-00000.json", "part-00000.txt"]


def test_a_rerun_with_relative_names_is_not_another_shard_count(
        tmp_path, monkeypatch):
    # `make demo` twice: --output_file=runs/demo/records/train.tfrecord is
    # relative, the glob of the folder absolute; the same shards are not
    # "another shard count".
    from input_pipelines import bert_instances as bi
    from input_pipelines import shard_writer
    monkeypatch.chdir(tmp_path)
    (tmp_path / "records").mkdir()
    names = bi.shard_names("records/train.tfrecord", 2)
    for name in names:
        (tmp_path / name).write_bytes(b"")
    pattern = str(tmp_path / "records" / "train-*-of-*.tfrecord")
    assert shard_writer.other_shards(pattern, names) == []
    (tmp_path / "records" / "train-00000-of-00003.tfrecord").write_bytes(b"")
    assert shard_writer.other_shards(pattern, names) == [
        str(tmp_path / "records" / "train-00000-of-00003.tfrecord")]
