"""tfscale-run: horovodrun's command line, started through Open MPI.

    tfscale-run -np 4 -H localhost:4 python train.py
    tfscale-run -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py
    tfscale-run -np 8 --hostfile hosts -p 2222 --network-interface eth0 \
        python train.py

The ranks are those of one `mpirun` (Open MPI's, which starts the ranks on
remote hosts itself over ssh), run by `launch.local`'s MPI group: each line
prefixed `[worker i]`, SIGTERM and Ctrl-C passed on to every rank, a dead
rank named and the others stopped, `--max-restarts` attempts. Scripts use
`tfscale.horovod` (or tfscale's Trainer with `--backend=mpi`).

Never imports TensorFlow.
"""

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from typing import List, Sequence, Tuple

from launch import elastic, local, mpi_ranks, workers
from tfscale.cluster.contract import seconds_problem

# horovodrun options tfscale-run refuses, with what to use instead.
_REFUSED = {
    "--gloo": "tfscale-run runs MPI only (Open MPI from PyPI: pip install "
              "'.[mpi]' in tfscale's checkout)",
    "--jsrun": "start the ranks with jsrun or srun --mpi=pmix directly",
    "--blacklist-cooldown-range": "a host that failed --host-failures times "
                                  "is left out for the rest of the run",
    "--timeline-filename": "no Horovod timeline: profile with TensorBoard "
                           "(tf.profiler.experimental)",
    "--autotune": "no Horovod autotuning: gradients are fused into one "
                  "all-reduce per dtype",
    "--fusion-threshold-mb": "gradients are fused into one all-reduce per "
                             "dtype (DistributedOptimizer(num_groups=N) "
                             "splits them)",
    "--cycle-time-ms": "there is no background cycle: each all-reduce runs "
                       "when the step reaches it",
    "--output-filename": "every line of the launcher's output is prefixed "
                         "[worker i]: tee it, or grep one rank",
    "--hierarchical-allreduce": "Open MPI chooses the algorithm; pass "
                                "--mpi-args \"--mca coll_tuned_...\"",
}
_REFUSED_SWITCHES = ("--gloo", "--jsrun", "--autotune",
                     "--hierarchical-allreduce")
# horovodrun options accepted with no effect here (nothing to cache, no
# Horovod log); listed so scripts that pass them keep working.
_IGNORED = ("--disable-cache", "--mpi")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# Not passed to remote ranks: the launcher host's own session and MPI's.
_NOT_FORWARDED = re.compile(
    r"^(_|PWD|OLDPWD|SHLVL|HOSTNAME|HOME|TERM|DISPLAY|SSH_.*|BASH_FUNC_.*|"
    r"OMPI_.*|PMIX_.*|PRTE_.*|OPAL_PREFIX|SLURM_.*|LS_COLORS)$")


class UsageError(ValueError):
    """A bad command line (one line, naming the flag)."""


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """'server1:4,server2:4' -> [('server1', 4), ('server2', 4)]
    (a host without ':N' has 1 slot, as in horovodrun)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, colon, slots = item.rpartition(":")
        if not colon:
            name, slots = item, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise UsageError(f"-H {spec}: {item!r} is not host:slots "
                             "(e.g. server1:4)")
        hosts.append((name, int(slots)))
    if not hosts:
        raise UsageError(f"-H {spec!r}: no hosts")
    return hosts


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Hosts of an Open MPI / horovodrun hostfile ('host slots=N' lines)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"--hostfile {path}: {e.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = 1
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key == "slots":
                if not value.isdigit() or int(value) < 1:
                    raise UsageError(f"--hostfile {path}: line {number}: "
                                     f"slots must be >= 1, got {value!r}")
                slots = int(value)
        hosts.append((parts[0], slots))
    if not hosts:
        raise UsageError(f"--hostfile {path}: no hosts")
    return hosts


def is_local(hosts: Sequence[Tuple[str, int]]) -> bool:
    names = _LOCAL_NAMES | {socket.gethostname(), socket.getfqdn()}
    return all(name in names for name, _ in hosts)


def open_mpi_major(mpirun: str) -> int:
    """Open MPI's major version of `mpirun`.

    Raises:
        UsageError: It is not Open MPI's.
    """
    try:
        text = subprocess.run([mpirun, "--version"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"--mpirun {mpirun}: {e}") from None
    found = re.search(r"Open MPI\)?\s+(\d+)\.", text)
    if not found:
        first = text.strip().splitlines()[0] if text.strip() else "no output"
        raise UsageError(
            f"{mpirun} is not Open MPI's mpirun ({first}): tfscale-run "
            "builds Open MPI's command line; pip install '.[mpi]' in "
            "tfscale's checkout or pass --mpirun PATH (MPICH users: "
            "mpiexec -n N python ...)")
    return int(found.group(1))


def mpirun_args(args, hosts: Sequence[Tuple[str, int]], env_names,
                major: int) -> List[str]:
    """The mpirun options (before the command) for parsed `args`.

    Args:
        args: `parse_args`' result.
        hosts: The hosts and slots (from -H, --hostfile or the default).
        env_names: Variables to forward to remote ranks (`-x NAME`).
        major: Open MPI's major version (5 renamed rsh to ssh).
    """
    out = []
    if args.hostfile:
        out += ["--hostfile", args.hostfile]
    else:
        out += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    out += ["--map-by", "slot", "--bind-to", "none"]
    ssh = []
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    if ssh:
        if major >= 5:
            out += ["--prtemca", "plm_ssh_args", " ".join(ssh)]
        else:
            out += ["--mca", "plm_rsh_args", " ".join(ssh)]
    if args.network_interface:
        nics = args.network_interface
        out += ["--mca", "btl_tcp_if_include", nics,
                "-x", f"NCCL_SOCKET_IFNAME={nics}"]
        if major >= 5:
            out += ["--prtemca", "oob_tcp_if_include", nics]
        else:
            out += ["--mca", "oob_tcp_if_include", nics]
    if args.tcp:
        out += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
    for name in sorted(env_names):
        out += ["-x", name]
    out += shlex.split(args.mpi_args or "")
    return out


def forwarded(env) -> List[str]:
    """The variables remote ranks get (local ranks inherit everything)."""
    return [name for name, value in env.items()
            if not _NOT_FORWARDED.match(name) and "\n" not in value]


def _parser() -> argparse.ArgumentParser:
    """horovodrun's flags, and those it has that tfscale-run does not."""
    parser = argparse.ArgumentParser(
        prog="tfscale-run",
        description="Run a Horovod-style training script on N ranks "
                    "through Open MPI (horovodrun's flags).",
        usage="%(prog)s -np N [-H host:slots,...] [options] command ...")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int,
                        default=None, help="number of ranks")
    parser.add_argument("-H", "--hosts", dest="hosts", default=None,
                        help="host:slots,... (default localhost:NP)")
    parser.add_argument("-hostfile", "--hostfile", dest="hostfile",
                        default=None, help="'host slots=N' per line")
    parser.add_argument("-p", "--ssh-port", dest="ssh_port", type=int,
                        default=None,
                        help="the remote hosts' sshd port (mpirun's ssh)")
    parser.add_argument("-i", "--ssh-identity-file",
                        dest="ssh_identity_file", default=None,
                        help="the key mpirun's ssh uses")
    parser.add_argument("--start-timeout", dest="start_timeout", type=float,
                        default=None,
                        help="seconds for every rank to reach hvd.init() "
                             "(default: HOROVOD_START_TIMEOUT, else 30)")
    parser.add_argument("--network-interface", "--network-interfaces",
                        dest="network_interface", default=None,
                        help="NICs for MPI's TCP traffic, e.g. eth0,eth1")
    parser.add_argument("--mpi-args", dest="mpi_args", default="",
                        help="extra mpirun options, quoted")
    parser.add_argument("--tcp", action="store_true",
                        help="TCP only (no shared memory or InfiniBand)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the mpirun command")
    parser.add_argument("--log-level", dest="log_level", default=None,
                        help="accepted (sets HOROVOD_LOG_LEVEL)")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int,
                        default=0, help="restart all ranks from the last "
                                        "checkpoint this many times")
    parser.add_argument("--mpirun", default=None,
                        help="the mpirun to use (default: beside this "
                             "Python, else on PATH)")
    parser.add_argument("--gpus-per-worker", "--gpus_per_worker",
                        dest="gpus_per_worker", type=int, default=None,
                        help="each rank sees only its K GPUs (local rank i: "
                             "GPUs i*K..i*K+K-1 of its host, through "
                             "CUDA_VISIBLE_DEVICES). Default: not set, as "
                             "horovodrun (Horovod scripts pick "
                             "gpus[hvd.local_rank()] themselves)")
    _add_elastic_options(parser)
    parser.add_argument("--check-build", dest="check_build",
                        action="store_true",
                        help="show what is available and exit")
    for flag in _IGNORED:
        parser.add_argument(flag, action="store_true",
                            help=argparse.SUPPRESS)
    for flag in _REFUSED:
        parser.add_argument(
            flag, dest="refused_" + flag.strip("-").replace("-", "_"),
            help=argparse.SUPPRESS, default=None,
            **({"action": "store_true"} if flag in _REFUSED_SWITCHES
               else {}))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def _add_elastic_options(parser) -> None:
    """Horovod's elastic flags (launch/elastic.py)."""
    group = parser.add_argument_group(
        "elastic", "ranks on the hosts a script finds, changing while the "
        "job runs, through its checkpoints (docs/launching.md, 'At scale')")
    group.add_argument("--host-discovery-script",
                       dest="host_discovery_script", default=None,
                       help="prints the usable hosts, 'host:slots' or "
                            "'host' a line; run at start and every "
                            "--discovery-interval seconds")
    group.add_argument("--min-np", dest="min_np", type=int, default=None,
                       help="fewest ranks to train on (default: -np)")
    group.add_argument("--max-np", dest="max_np", type=int, default=None,
                       help="most ranks to train on (default: -np)")
    group.add_argument("--slots", "--slots-per-host", dest="slots",
                       type=int, default=1,
                       help="slots of a host the script prints without "
                            "':N' (default 1)")
    group.add_argument("--elastic-timeout", dest="elastic_timeout",
                       type=float, default=600.0,
                       help="seconds to wait for --min-np slots before the "
                            "job ends (default 600)")
    group.add_argument("--discovery-interval", dest="discovery_interval",
                       type=float, default=5.0,
                       help="seconds between runs of the script while "
                            "training (default 5)")
    group.add_argument("--host-failures", dest="host_failures", type=int,
                       default=2,
                       help="a host whose ranks failed this many times is "
                            "left out for the rest of the run (default 2)")
    group.add_argument("--reset-limit", dest="reset_limit", type=int,
                       default=None,
                       help="Horovod's name for --max-restarts here: "
                            "restarts after failures (a change of hosts "
                            "is not counted)")


def elastic_config(args):
    """The `elastic.ElasticConfig` of parsed `args`, or None without
    --host-discovery-script."""
    if not args.host_discovery_script:
        return None
    return elastic.ElasticConfig(
        min_np=args.min_np or args.num_proc, max_np=args.max_np or
        args.num_proc, discovery_script=args.host_discovery_script,
        slots_per_host=args.slots, poll_seconds=args.discovery_interval,
        timeout_seconds=args.elastic_timeout,
        host_failures=args.host_failures)


def parse_args(argv: Sequence[str]):
    parser = _parser()
    args = parser.parse_args(list(argv))
    for flag, instead in _REFUSED.items():
        if getattr(args, "refused_" + flag.strip("-").replace("-", "_")):
            parser.error(f"{flag} is not offered: {instead}")
    if args.check_build:
        return args
    if args.reset_limit is not None:
        args.max_restarts = args.reset_limit
    if args.num_proc is None and args.host_discovery_script:
        args.num_proc = args.min_np or args.max_np
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        parser.error("--host-discovery-script finds the hosts: no -H or "
                     "--hostfile with it")
    if (args.min_np or args.max_np) and not args.host_discovery_script:
        parser.error("--min-np and --max-np need --host-discovery-script")
    try:
        elastic_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run (e.g. python train.py)")
    if args.num_proc < 1:
        parser.error(f"-np must be >= 1, got {args.num_proc}")
    if args.hosts and args.hostfile:
        parser.error("pass -H or --hostfile, not both")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    problem = seconds_problem("start_timeout", args.start_timeout,
                              "--start-timeout")
    if problem:
        parser.error(problem)
    if args.gpus_per_worker is not None and args.gpus_per_worker < 0:
        parser.error("--gpus-per-worker must be >= 0")
    return args


def resolve_hosts(args) -> List[Tuple[str, int]]:
    """The hosts the ranks go to; raises UsageError when they hold fewer
    slots than -np asks for."""
    if args.hostfile:
        hosts = parse_hostfile(args.hostfile)
        where = f"--hostfile {args.hostfile}"
    elif args.hosts:
        hosts = parse_hosts(args.hosts)
        where = f"-H {args.hosts}"
    else:
        return [("localhost", args.num_proc)]
    slots = sum(s for _, s in hosts)
    if slots < args.num_proc:
        raise UsageError(f"-np {args.num_proc} needs {args.num_proc} slots; "
                         f"{where} has {slots}")
    return hosts


def check_build() -> str:
    """horovodrun --check-build's table, for tfscale."""
    try:
        import importlib.util
        has_mpi4py = importlib.util.find_spec("mpi4py") is not None
    except ImportError:
        has_mpi4py = False

    def mark(flag):
        return "[X]" if flag else "[ ]"
    return "\n".join([
        "tfscale.horovod (the horovod.tensorflow API on TensorFlow 2.21):",
        "",
        "Available Frameworks:",
        "    [X] TensorFlow", "    [ ] PyTorch", "    [ ] MXNet",
        "", "Available Controllers:",
        f"    {mark(has_mpi4py)} MPI (mpi4py)", "    [ ] Gloo",
        "", "Available Tensor Operations:",
        "    [ ] NCCL (GPU jobs: tfscale's Trainer, backend mwms)",
        "    [ ] DDL", "    [ ] CCL", f"    {mark(has_mpi4py)} MPI",
        "    [ ] Gloo"])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.check_build:
        print(check_build())
        return 0
    if args.host_discovery_script:
        return _run_elastic(args)
    try:
        hosts = resolve_hosts(args)
        mpirun = mpi_ranks.find_mpirun(args.mpirun)
        major = open_mpi_major(mpirun)
    except (UsageError, ValueError) as e:
        print(f"tfscale-run: error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    timeout = args.start_timeout or env.get("HOROVOD_START_TIMEOUT") or "30"
    env["HOROVOD_START_TIMEOUT"] = str(timeout)
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    threads = (workers.default_threads(args.num_proc) if is_local(hosts)
               else None)
    rank_env = mpi_ranks.mpi_env(env, threads)
    names = [] if is_local(hosts) else forwarded(rank_env)
    extra = mpirun_args(args, hosts, names, major)
    if args.verbose:
        command = mpi_ranks.mpirun_command(
            args.command, args.num_proc, mpirun, extra_args=extra,
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
        print("[launcher] " + shlex.join(command), flush=True)
    try:
        return local.run(args.command, args.num_proc, backend="mpi",
                         mpirun=mpirun, mpirun_args=extra,
                         threads_per_worker=threads, base_env=env,
                         max_restarts=args.max_restarts,
                         gpus_per_worker=args.gpus_per_worker,
                         bind_gpus=False, watch_heartbeats=is_local(hosts))
    except ValueError as e:
        print(f"tfscale-run: error: {e}", file=sys.stderr)
        return 2


def _run_elastic(args) -> int:
    """Each attempt one mpirun over the hosts the script finds then
    (`launch/elastic.py`)."""
    config = elastic_config(args)
    try:
        mpirun = mpi_ranks.find_mpirun(args.mpirun)
        major = open_mpi_major(mpirun)
    except ValueError as e:
        print(f"tfscale-run: error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("HOROVOD_START_TIMEOUT", str(args.start_timeout or 30))
    names = forwarded(mpi_ranks.mpi_env(env, None))
    membership = elastic.Membership(config)
    plan = elastic.Elastic(
        membership, lambda hosts: mpirun_args(args, hosts, names, major))
    try:
        return local.run(args.command, config.max_np, backend="mpi",
                         mpirun=mpirun, base_env=env,
                         max_restarts=args.max_restarts,
                         gpus_per_worker=args.gpus_per_worker,
                         bind_gpus=False, elastic=plan)
    except ValueError as e:  # DiscoveryError too
        print(f"tfscale-run: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
