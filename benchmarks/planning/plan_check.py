r"""tfscale-plan against real runs: hosts with their own addresses and
links limited by `tc`, 2 workers to calibrate, 3 to check.

    python -m benchmarks.planning.plan_check --output_dir runs/plan_check \
        --rates 100,400 --models bert_tiny,resnet50

As root: makes hosts node1..node3 (tests/hosts/local_hosts.sh: network
namespaces on one bridge), and for each rate limits every host's link to
RATE Mbit/s in both directions (a `tc` token bucket on each end of its veth
pair). For each model it runs the job on 2 workers (node1, node2), then on
3, MultiWorkerMirroredStrategy from a TF_CONFIG naming the hosts (as
Kubernetes gives it), each worker on one TensorFlow thread. tfscale-plan
calibrates on the 2-worker run's summary.json (its compute, update and
jitter; its sync gives the link's efficiency) and predicts the 3-worker
step time and the sync's share of it. The hosts share this machine's CPUs
(3 workers on 2 cores compute slower than 2): the report shows the
measured compute beside the prediction's. Output: report.md, results.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import harness
from benchmarks.harness import REPO
from launch.workers import thread_env
from planning import calibrate, projection, systems
from planning.workload import from_summary

HOSTS = os.path.join(REPO, "tests", "hosts", "local_hosts.sh")
PORT = 23456


def sh(command: str) -> None:
    subprocess.run(["bash", "-c", command], check=True, cwd=REPO)


def make_hosts(count: int) -> None:
    sh(f"source {HOSTS} && local_hosts {count}")


def limit_links(count: int, mbit: int) -> None:
    """Each host's link at `mbit` Mbit/s both ways: a token bucket on the
    bridge's end (traffic to the host) and on the host's end (from it)."""
    rule = f"tbf rate {mbit}mbit burst 256kb latency 400ms"
    for i in range(1, count + 1):
        sh(f"tc qdisc replace dev vh{i} root {rule}")
        sh(f"ip netns exec node{i} tc qdisc replace dev vn{i} root {rule}")


def make_data(out: str) -> dict:
    py = sys.executable
    corpus, images = os.path.join(out, "corpus"), os.path.join(out, "images")
    if not os.path.exists(os.path.join(out, "records")):
        sh(f"{py} -m input_pipelines.make_demo_corpus --output_dir={corpus}")
        sh(f"{py} -m input_pipelines.create_pretraining_data "
           f"--input_file={corpus}/corpus.txt --vocab_file={corpus}/vocab.txt "
           f"--output_file={out}/records/train.tfrecord --num_output_shards=4 "
           "--max_seq_length=64 --max_predictions_per_seq=10 --dupe_factor=2")
    if not os.path.exists(images):
        sh(f"{py} -m input_pipelines.make_demo_images --output_dir={images} "
           "--num_classes=10 --images_per_class=40 --eval_images_per_class=2")
    return {"bert_tiny": [
        "run_pretraining", f"--input_file={out}/records/train-*.tfrecord",
        f"--bert_config_file={corpus}/bert_config.json",
        "--max_seq_length=64", "--max_predictions_per_seq=10",
        "--train_batch_size=48", "--optimizer=lamb", "--learning_rate=1e-3"],
        "resnet50": [
        "train_image_classifier", f"--train_files={images}/records/train-*",
        "--num_classes=10", "--image_size=32", "--train_batch_size=24"]}


def run_job(args, workers: int, output_dir: str, steps: int) -> dict:
    """The job on node1..nodeN; its chief's summary.json path."""
    hosts = [f"10.77.0.{i}:{PORT}" for i in range(1, workers + 1)]
    procs = []
    for index in range(workers):
        env = dict(os.environ, PYTHONPATH=REPO, **thread_env(1),
                   TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                         "task": {"type": "worker",
                                                  "index": index}}))
        log = open(os.path.join(output_dir, f"worker-{index}.log"), "w")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", f"node{index + 1}", sys.executable, "-m",
             *args, f"--output_dir={output_dir}", f"--num_train_steps={steps}",
             "--log_steps=4", f"--save_checkpoints_steps={10 * steps}",
             "--num_warmup_steps=0"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{args[0]} on {workers} hosts exited {codes}: "
                           f"see {output_dir}/worker-*.log")
    return os.path.join(output_dir, "summary.json")


def local_system(mbit: int) -> systems.System:
    """One worker a host, one NIC of `mbit` Mbit/s; latency of TCP over
    the bridge guessed at 100 us a hop."""
    return systems.System(
        f"hosts-{mbit}mbit", "CPU (1 thread)", 1, 1.0, 10e9,
        intra_bandwidth=10e9, intra_latency=0.0,
        nic_bandwidth=mbit * 1e6 / 8, nics_per_node=1,
        network_efficiency=1.0, nic_latency=100e-6, base_latency=1e-3)


def predict(two: str, mbit: int) -> dict:
    """3 workers' step from the 2-worker run's summary.json."""
    facts = from_summary(two)
    system = calibrate.link_from_sync(facts, local_system(mbit))
    split = projection.step_split(facts.workload, system, 3)
    step = sum(split.values())
    return {"step": step, "sync_share": split["sync"] / step,
            "compute": split["compute"],
            "network_efficiency": system.network_efficiency}


def measured(path: str) -> dict:
    facts = from_summary(path)
    w = facts.workload
    step = (w.micro_seconds * w.accumulation + w.update_seconds
            + w.fixed_seconds + facts.sync_seconds)
    steady = [r for r in json.load(open(path))["intervals"]
              if not r["first"]]
    wall = sum(r["step_time"] * r["steps"] for r in steady) / sum(
        r["steps"] for r in steady)
    return {"step": wall, "sync_share": facts.sync_seconds / step,
            "compute": w.micro_seconds * w.accumulation}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="runs/plan_check",
                   help="folder for report.md and results.json")
    p.add_argument("--rates", default="100,400",
                   help="link rates in Mbit/s, comma-separated (a tc token "
                        "bucket on each host's link)")
    p.add_argument("--models", default="bert_tiny,resnet50",
                   help="models, comma-separated")
    p.add_argument("--steps", type=int, default=20,
                   help="steps timed in each run")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("plan_check: needs root (network namespaces, tc)",
              file=sys.stderr)
        return 2
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    make_hosts(3)
    jobs = make_data(os.path.join(out, "data"))
    results = []
    for mbit in (int(r) for r in args.rates.split(",")):
        limit_links(3, mbit)
        for model in args.models.split(","):
            paths = {}
            for workers in (2, 3):
                run_dir = os.path.join(out, f"{model}-{mbit}mbit-{workers}w")
                subprocess.run(["rm", "-rf", run_dir], check=True)
                os.makedirs(run_dir)
                start = time.time()
                paths[workers] = run_job(jobs[model], workers, run_dir,
                                         args.steps)
                print(f"{model} {mbit} Mbit/s {workers} workers: "
                      f"{time.time() - start:.0f} s", flush=True)
            row = {"model": model, "mbit": mbit,
                   "measured_2": measured(paths[2]),
                   "predicted_3": predict(paths[2], mbit),
                   "measured_3": measured(paths[3])}
            results.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report(results))
    print(report(results))
    return 0


def report(results) -> str:
    def cells(r):
        two, pred, three = r["measured_2"], r["predicted_3"], r["measured_3"]
        return [r["model"], f"{r['mbit']} Mbit/s",
                f"{1e3 * two['step']:.0f} ms, {two['sync_share']:.0%}",
                f"{1e3 * pred['step']:.0f} ms, {pred['sync_share']:.0%}",
                f"{1e3 * three['step']:.0f} ms, {three['sync_share']:.0%}",
                f"{pred['step'] / three['step'] - 1:+.0%}",
                f"{100 * (pred['sync_share'] - three['sync_share']):+.0f} pts",
                f"{1e3 * two['compute']:.0f} / {1e3 * three['compute']:.0f} "
                "ms"]

    return harness.table(
        ["model", "link", "2 workers: step, sync share",
         "3 workers predicted: step, sync share",
         "3 workers measured: step, sync share", "step error",
         "share error", "compute 2 / 3 measured"],
        map(cells, results), align="lllllrrl") + "\n"


if __name__ == "__main__":
    sys.exit(main())
