"""tf.data service: the per-record work runs on other processes or hosts.

    records = TFRecordConfig(files, order="sharded",
                             service=ServiceConfig("dispatcher-host:5050"))

With a `ServiceConfig` in its `TFRecordConfig`, a pipeline is built whole
(every file, no per-trainer sharding) on the trainer, registered with the
dispatcher, and run by the service's workers: reading, shuffling, parsing,
JPEG decoding, augmentation and batching all happen there. The trainers
share one job and only receive finished per-replica batches (gRPC, then a
prefetch), so a decode-bound trainer spends its CPU on the step.

What runs where:

    trainer:        flags -> this config -> the pipeline's graph -> register
    service worker: files -> interleave -> shuffle -> parse -> decode/crop
                    -> batch  (each worker runs its own copy of the graph)
    trainer:        <- batches over gRPC -> prefetch -> the step

Processing modes (TensorFlow's names) decide what an epoch is:

  * "distributed_epoch" (default): the dispatcher deals the files out to the
    service workers as they ask for more; every record is read once per
    epoch across all workers (then the pipeline repeats). A service worker
    that dies loses the records it had in flight (at most once).
  * "parallel_epochs": every service worker reads every file in its own
    order; an epoch of the job delivers each record once per service
    worker. For inputs that cannot be split (no file source).

What the service trades away, against the global order:

  * Its order is not deterministic: which worker's batch a trainer gets
    depends on timing. Augmentation seeds come from (seed, the record's
    bytes, its place in the worker's stream), so no two workers crop alike.
  * Its position is not in the checkpoint (a service iterator cannot be
    saved). A resumed run rejoins the same job (named after the output
    directory) and goes on from where the service is: records delivered
    after the last checkpoint are not delivered again; if the service was
    restarted too, its epoch starts over.

The servers: `python -m input_pipelines.service dispatcher --port P
--work_dir DIR` and `... worker --dispatcher HOST:P`. The dispatcher runs in
TensorFlow's fault-tolerant mode: it journals its state to the work
directory, so a restarted dispatcher (same port, same directory) resumes
its jobs; a worker that stops heartbeating is dropped after
`WORKER_TIMEOUT_SECONDS` while the trainers read from the others.
`launch.local --data_service_workers K` starts a dispatcher and K workers
beside the training workers, replaces any that dies and tells the trainers
the address (`ADDRESS_ENV`); `launch/slurm_data_service.sbatch` puts the
service on nodes of its own.
"""

import argparse
import dataclasses
import os
import re
import socket
import sys
import time
from typing import Callable, Optional

import tensorflow as tf

from tfscale.cluster.contract import DATA_SERVICE_ADDRESS_ENV

PROCESSING_MODES = ("distributed_epoch", "parallel_epochs")
COMPRESSIONS = ("auto", "none")
# The launcher's dispatcher address, for entry points without the flag.
ADDRESS_ENV = DATA_SERVICE_ADDRESS_ENV


class ServiceError(ValueError):
    """The dispatcher cannot be reached; the message names the address."""


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Where the tf.data service is and how the trainers use it.

    Attributes:
        address: The dispatcher, "host:port" (a "grpc://" prefix is fine).
        processing_mode: "distributed_epoch" or "parallel_epochs" (module
            doc).
        job_name: The job all trainers of a run share (they split its
            batches); a resumed run with the same name rejoins it.
        compression: "auto" (TensorFlow compresses batches on the service
            worker; less network, more trainer CPU) or "none".
        connect_timeout_seconds: How long to wait for the dispatcher to
            answer before failing.
        max_outstanding_requests: Batches a trainer asks for at once
            (None: TensorFlow's default, one per service worker).
    """

    address: str
    processing_mode: str = "distributed_epoch"
    job_name: str = "tfscale-train"
    compression: str = "none"
    connect_timeout_seconds: float = 120.0
    max_outstanding_requests: Optional[int] = None

    def __post_init__(self):
        host, port = split_address(self.address)
        if not host or not port.isdigit():
            raise ValueError(f"data_service must be HOST:PORT, got "
                             f"{self.address!r}")
        if self.processing_mode not in PROCESSING_MODES:
            raise ValueError(f"data_service_mode must be one of "
                             f"{PROCESSING_MODES}, got "
                             f"{self.processing_mode!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"data_service_compression must be one of "
                             f"{COMPRESSIONS}, got {self.compression!r}")
        if self.connect_timeout_seconds <= 0:
            raise ValueError("connect_timeout must be > 0")

    @property
    def target(self) -> str:
        """The address as `tf.data.experimental.service` wants it."""
        host, port = split_address(self.address)
        return f"grpc://{host}:{port}"


def split_address(address: str):
    """("host", "port") of "host:port" or "grpc://host:port"."""
    bare = address.split("://", 1)[-1]
    host, _, port = bare.rpartition(":")
    return host.strip("[]"), port


def job_name_for(output_dir: str) -> str:
    """The job name of a run: one per output directory, so that a resumed
    run rejoins its job and two runs on one dispatcher do not share one."""
    path = os.path.abspath(output_dir)
    return f"tfscale-{os.path.basename(path) or 'run'}-{_digest(path)}"


def _digest(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_reachable(config: ServiceConfig, clock=time.monotonic) -> None:
    """Waits until the dispatcher accepts connections (it may still be
    starting), for `connect_timeout_seconds` at most. TensorFlow's own
    client would wait forever.

    Raises:
        ServiceError: One line naming the address and the last error.
    """
    host, port = split_address(config.address)
    deadline = clock() + config.connect_timeout_seconds
    while True:
        left = deadline - clock()
        try:
            with socket.create_connection((host, int(port)),
                                          timeout=max(0.1, min(left, 5.0))):
                return
        except OSError as e:
            error = e
        if clock() >= deadline:
            reason = (error.strerror or str(error)).lower()
            raise ServiceError(
                f"no tf.data service dispatcher answers at {host}:{port} "
                f"within {config.connect_timeout_seconds:g} s ({reason}; "
                "--connect_timeout)")
        time.sleep(min(0.5, max(0.0, deadline - clock())))


def distribute(dataset: tf.data.Dataset, config: ServiceConfig
               ) -> tf.data.Dataset:
    """`dataset`, run by the service: this trainer's share of the job's
    elements, prefetched."""
    ds = dataset.apply(tf.data.experimental.service.distribute(
        processing_mode=config.processing_mode, service=config.target,
        job_name=config.job_name,
        compression="AUTO" if config.compression == "auto" else None,
        max_outstanding_requests=config.max_outstanding_requests))
    return ds.prefetch(tf.data.AUTOTUNE)


def worker_seed() -> tf.Tensor:
    """An int64 seed drawn when a service worker starts its copy of the
    pipeline (its clock in microseconds): "parallel_epochs" workers must not
    all shuffle alike, and one graph serves them all."""
    return tf.cast(tf.timestamp() * 1e6, tf.int64)


class ServiceDatasetFn:
    """`fn(InputContext) -> dataset` whose batches come from the service.

    Args:
        build: `fn(seed) -> tf.data.Dataset`: the whole pipeline (every
            file, no sharding), with `seed` (an int64 scalar tensor, or
            None for the config's) as the seed of its shuffles.
        config: The service.

    The trainer saves no input position for it (`resumable` is False).
    """

    resumable = False

    def __init__(self, build: Callable, config: ServiceConfig):
        self._build = build
        self.config = config

    def __call__(self, input_context=None) -> tf.data.Dataset:
        if self.config.processing_mode == "parallel_epochs":
            dataset = tf.data.Dataset.from_tensors(0).map(
                lambda _: worker_seed()).flat_map(self._build_seeded)
        else:
            dataset = self._build(None)
        return distribute(dataset, self.config)

    def _build_seeded(self, seed):
        """The pipeline with a service worker's own seed. Its graph takes no
        seed from the process's global one: TensorFlow 2.21's `get_seed`
        compares (global seed, op seed) with (0, 0), which raises for a
        tensor op seed at a global seed of 0 (`--seed=0`). The worker's seed
        is its clock's, so nothing repeatable is lost."""
        tf.random.set_seed(None)
        return self._build(seed)


_WORKER_ERROR = re.compile(
    r"Failed to get element from worker (\S+?):? Failed to get an element"
    r"(?:, with a nonretryable error)?: (?:Failed to get element: )?(.*?)(?:\s*\[Op:.*)?$")


def worker_message(message: str) -> str:
    """TensorFlow's error from a service worker, said plainly:
    "tf.data service worker HOST:PORT: <its error>" (other text unchanged)."""
    found = _WORKER_ERROR.search(message)
    if not found:
        return message
    return f"tf.data service worker {found.group(1)}: {found.group(2)}"


# ---- the servers: python -m input_pipelines.service dispatcher|worker -------

# A dead worker is dropped (and its tasks given up) after this long.
WORKER_TIMEOUT_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0


def run_dispatcher(port: int, work_dir: str,
                    worker_timeout: float = WORKER_TIMEOUT_SECONDS) -> None:
    service = tf.data.experimental.service
    server = service.DispatchServer(service.DispatcherConfig(
        port=port, work_dir=work_dir, fault_tolerant_mode=True,
        worker_timeout_ms=int(worker_timeout * 1000)))
    print(f"tf.data service dispatcher at {socket.gethostname()}:{port} "
          f"(state in {work_dir})", flush=True)
    server.join()


def run_worker(dispatcher: str, port: int = 0,
                host: Optional[str] = None) -> None:
    service = tf.data.experimental.service
    host = host or _worker_host(dispatcher)
    server = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=dispatcher.split("://", 1)[-1], port=port,
        worker_address=f"{host}:%port%",
        heartbeat_interval_ms=int(HEARTBEAT_SECONDS * 1000)))
    print(f"tf.data service worker of {dispatcher} (pid {os.getpid()})",
          flush=True)
    server.join()


def _worker_host(dispatcher: str) -> str:
    """The name trainers reach this worker by: "localhost" beside a local
    dispatcher, else this host's name."""
    host = dispatcher.split("://", 1)[-1].rpartition(":")[0]
    if host in ("localhost", "127.0.0.1", "::1", "[::1]"):
        return "localhost"
    return socket.gethostname()


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m input_pipelines.service",
        description="Runs a tf.data service dispatcher or worker.")
    commands = parser.add_subparsers(dest="command", required=True)
    dispatcher = commands.add_parser("dispatcher", help="run a dispatcher")
    dispatcher.add_argument("--port", type=int, required=True)
    dispatcher.add_argument("--work_dir", required=True,
                            help="its journal (fault-tolerant mode): a "
                                 "restart with the same one resumes")
    dispatcher.add_argument("--worker_timeout", type=float,
                            default=WORKER_TIMEOUT_SECONDS,
                            help="seconds before a silent worker is dropped")
    worker = commands.add_parser("worker", help="run a worker")
    worker.add_argument("--dispatcher", required=True, help="HOST:PORT")
    worker.add_argument("--port", type=int, default=0,
                        help="its port (default: a free one)")
    worker.add_argument("--host", default=None,
                        help="the name trainers reach it by (default: "
                             "localhost beside a local dispatcher, else "
                             "this host's name)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "dispatcher":
        run_dispatcher(args.port, args.work_dir, args.worker_timeout)
    else:
        run_worker(args.dispatcher, args.port, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
