r"""Record writers' throughput on the prepare engine: images/s of
build_image_records and documents/s of create_pretraining_data, in one
process, on a local Dask cluster, and on a running scheduler's workers;
against an earlier tree's process pool; the engine's cost per task; and the
BERT writer's peak memory per worker for two corpus sizes.

    python -m benchmarks.pipelines.writers --images_per_class 100 --classes 10 \
        --corpus_copies 30 --output_dir runs/writers \
        [--baseline_repo /tmp/tfscale-before]   # e.g. git worktree add

Each tool runs as a user runs it (its command line, a fresh process), and
the rate is the one it prints on its last line (after its own start-up), so
the variants are compared on the same work in the same sitting:

- `1 process`: --num_processes=1 (no Dask);
- `local N`: --num_processes=N, a LocalCluster of N processes started by
  the tool (each imports TensorFlow);
- `scheduler N`: a `dask scheduler` and N `dask worker` processes started
  before (and warmed by one run), --scheduler_file: workers that stay up
  between jobs, as on a cluster;
- `pool N` (with --baseline_repo): the same command in an earlier checkout,
  whose tools used a spawn pool of N processes.
"""

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time

from benchmarks import harness
from benchmarks.harness import REPO

DASK = os.path.join(os.path.dirname(sys.executable), "dask")


def _run(command, cwd=REPO) -> str:
    return harness.run(command, what=command[2], checkout=cwd, env=dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


class Scheduler:
    """A `dask scheduler` and `workers` single-threaded `dask worker`s."""

    def __init__(self, folder: str, workers: int):
        os.makedirs(folder, exist_ok=True)
        self.file = os.path.join(folder, f"scheduler-{workers}.json")
        if os.path.exists(self.file):
            os.remove(self.file)
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        self._log = open(os.path.join(folder, f"dask-{workers}.log"), "w")
        self._processes = [subprocess.Popen(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", self.file], env=env,
            stdout=self._log, stderr=subprocess.STDOUT)]
        while not os.path.exists(self.file):
            time.sleep(0.1)
        self._processes += [subprocess.Popen(
            [DASK, "worker", "--scheduler-file", self.file, "--nthreads",
             "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
            for _ in range(workers)]
        import distributed
        with distributed.Client(scheduler_file=self.file) as client:
            client.wait_for_workers(workers, timeout=120)

    def peak_rss_mb(self) -> list:
        """Each worker's peak resident memory so far (MB)."""
        import distributed
        with distributed.Client(scheduler_file=self.file) as client:
            peaks = client.run(lambda: resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss)
        return sorted(kb / 1024 for kb in peaks.values())

    def close(self):
        for process in self._processes:
            process.kill()
            process.wait()
        self._log.close()


def images(args, variant, engine_args, cwd=REPO) -> float:
    out = os.path.join(os.path.abspath(args.output_dir), f"records-{variant}")
    shutil.rmtree(out, ignore_errors=True)
    text = _run([sys.executable, "-m", "input_pipelines.build_image_records",
                 f"--image_dir={os.path.abspath(args.output_dir)}/images",
                 f"--output_dir={out}", f"--num_shards={args.shards}",
                 "--noprogress", *engine_args], cwd)
    return float(re.search(r"\(([\d.]+) images/s\)", text).group(1))


def documents(args, variant, engine_args, cwd=REPO, copies=None,
              shards=None) -> float:
    out = os.path.join(os.path.abspath(args.output_dir), f"bert-{variant}")
    shutil.rmtree(out, ignore_errors=True)
    corpus = os.path.join(os.path.abspath(args.output_dir), "corpus")
    text = _run([sys.executable, "-m",
                 "input_pipelines.create_pretraining_data",
                 f"--input_file={corpus}/big-{copies or args.corpus_copies}.txt",
                 f"--vocab_file={corpus}/vocab.txt",
                 f"--output_file={out}/train.tfrecord",
                 f"--num_output_shards={shards or args.shards}",
                 "--max_seq_length=128", "--max_predictions_per_seq=20",
                 "--dupe_factor=2", "--noprogress", *engine_args], cwd)
    return float(re.search(r"\(([\d.]+) documents/s", text).group(1))


def _noop(task, progress):
    del progress
    return task


def engine_cost_per_task(args, tasks: int = 400) -> float:
    """Seconds per no-op task through `engine.run` on a running scheduler
    with 2 workers (the client's submit, the scheduler, the result)."""
    from input_pipelines.prepare import engine
    scheduler = Scheduler(os.path.join(args.output_dir, "dask"), 2)
    try:
        config = engine.EngineConfig(scheduler_file=scheduler.file)
        engine.run(list(range(20)), _noop, config=config, work=[1] * 20,
                   work_per_process=1, describe=str)
        start = time.perf_counter()
        engine.run(list(range(tasks)), _noop, config=config,
                   work=[1] * tasks, work_per_process=1, describe=str)
        return (time.perf_counter() - start) / tasks
    finally:
        scheduler.close()


def make_data(args):
    from input_pipelines import pattern_images
    if not os.path.isdir(os.path.join(args.output_dir, "images")):
        pattern_images.write_image_folder(
            os.path.join(args.output_dir, "images"), args.classes,
            args.images_per_class, seed=0)
    corpus = os.path.join(args.output_dir, "corpus")
    if not os.path.exists(os.path.join(corpus, "corpus.txt")):
        _run([sys.executable, "-m", "input_pipelines.make_demo_corpus",
              f"--output_dir={os.path.abspath(corpus)}"])
    with open(os.path.join(corpus, "corpus.txt")) as f:
        text = f.read().strip("\n") + "\n\n"
    for copies in {args.corpus_copies, 4 * args.corpus_copies}:
        path = os.path.join(corpus, f"big-{copies}.txt")
        if not os.path.exists(path):
            with open(path, "w") as f:
                # Each copy's documents differ by a marker line, so the
                # hash spreads them (identical documents share a bucket).
                for copy in range(copies):
                    f.write(text.replace("\n\n", f"\ncopy {copy}.\n\n"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=10,
                        help="image classes")
    parser.add_argument("--images_per_class", type=int, default=100,
                        help="synthetic images a class")
    parser.add_argument("--corpus_copies", type=int, default=30,
                        help="the demo corpus repeated this many times")
    parser.add_argument("--shards", type=int, default=8,
                        help="output shards")
    parser.add_argument("--repeats", type=int, default=2,
                        help="times each measurement is repeated")
    parser.add_argument("--output_dir", default="runs/writers",
                        help="folder for report.md and results.json")
    parser.add_argument("--baseline_repo", default=None,
                        help="an earlier checkout whose tools are run as "
                             "the 'pool' rows")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    make_data(args)
    cores = os.cpu_count() or 1
    rows = []
    schedulers = {n: Scheduler(os.path.join(args.output_dir, "dask"), n)
                  for n in sorted({1, cores})}
    try:
        variants = [("1 process", ["--num_processes=1"], REPO)]
        variants += [(f"local {cores}", [f"--num_processes={cores}"], REPO)]
        variants += [(f"scheduler {n}", [f"--scheduler_file={s.file}"], REPO)
                     for n, s in schedulers.items()]
        if args.baseline_repo:
            variants += [(f"pool {n}", [f"--num_processes={n}"],
                          os.path.abspath(args.baseline_repo))
                         for n in sorted({1, cores})]
        for _, engine_args, cwd in variants:  # warm the workers and caches
            if "scheduler" in engine_args[0]:
                images(args, "warm", engine_args, cwd)
        for _ in range(args.repeats):
            for name, engine_args, cwd in variants:
                tag = name.replace(" ", "")
                rows.append(("build_image_records", name,
                             images(args, tag, engine_args, cwd), "images/s"))
                rows.append(("create_pretraining_data", name,
                             documents(args, tag, engine_args, cwd),
                             "documents/s"))
                print(rows[-2], rows[-1], flush=True)
    finally:
        for scheduler in schedulers.values():
            scheduler.close()
    cost = engine_cost_per_task(args)
    # Peak memory per worker: the corpus x1 and x4 with the same shards
    # (buckets 4x larger), and x4 with 4x the shards (the same bucket size).
    memory = []
    for copies, shards in ((args.corpus_copies, args.shards),
                           (4 * args.corpus_copies, args.shards),
                           (4 * args.corpus_copies, 4 * args.shards)):
        scheduler = Scheduler(os.path.join(args.output_dir, "dask"), 2)
        try:
            before = scheduler.peak_rss_mb()
            documents(args, f"mem{copies}-{shards}",
                      [f"--scheduler_file={scheduler.file}"], REPO, copies,
                      shards)
            memory.append((copies, shards, before, scheduler.peak_rss_mb()))
        finally:
            scheduler.close()
    lines = [f"{args.classes * args.images_per_class} patterned JPEGs "
             f"(300-500 px) into {args.shards} shards; the demo corpus x"
             f"{args.corpus_copies} into {args.shards} shards (seq 128, "
             f"dupe_factor 2); {cores} cores, {args.repeats} repeats:", "",
             harness.table(["tool", "engine", "rate", "unit"],
                           ([tool, name, f"{rate:.1f}", unit]
                            for tool, name, rate, unit in rows),
                           align="llrl")]
    lines += ["", f"Engine cost per task (no-op tasks, running scheduler, 2 "
                  f"workers): {1000 * cost:.2f} ms", "",
              harness.table(
                  ["corpus", "shards", "worker peak RSS before (MB)",
                   "after (MB)"],
                  ([f"demo x{c}", s, ", ".join(f"{m:.0f}" for m in b),
                    ", ".join(f"{m:.0f}" for m in a)]
                   for c, s, b, a in memory), align="lrll")]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
