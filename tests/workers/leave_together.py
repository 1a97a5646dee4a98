"""A worker that all-reduces, then leaves the way the entry points do.

The chief first spends `--chief_seconds` alone (as when it exports a model);
every other worker waits `--report_delay` seconds before it reports leaving
the last barrier, so a chief that exited right after the barrier would take
the coordination service away from under it. Prints when each worker
reports and leaves, and exits through `tfscale.cli.leave`.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from tfscale import cli  # noqa: E402
from tfscale import _compat  # noqa: E402
from tfscale.cluster import environment as cluster_lib  # noqa: E402
from tfscale.cluster import strategies  # noqa: E402
from tfscale.cluster import collectives  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chief_seconds", type=float, default=1.0)
    parser.add_argument("--report_delay", type=float, default=2.0)
    args = parser.parse_args()
    info = cluster_lib.resolve_cluster()
    strategy = strategies.make_strategy(info, cluster_lib.ClusterConfig())
    workers = collectives.make("mwms", strategy)

    @tf.function
    def total():
        return strategy.run(lambda: workers.all_reduce([tf.ones([1 << 16])]))

    for _ in range(3):
        value = strategy.experimental_local_results(total())[0][0]
        assert float(value[0]) == workers.num_replicas, value
    if workers.is_chief:
        time.sleep(args.chief_seconds)
    else:
        service = _compat.coordination_service()
        report = service.set_config_key_value

        def late_report(key, value):
            time.sleep(args.report_delay)
            print(f"reporting {workers.worker_index} at {time.time():.6f}",
                  flush=True)
            report(key, value)

        service.set_config_key_value = late_report
    workers.leave_together()
    print(f"left {workers.worker_index} at {time.time():.6f}", flush=True)
    cli.leave(0)


if __name__ == "__main__":
    sys.exit(main())
