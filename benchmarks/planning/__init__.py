"""tfscale-plan's checks: against real runs on hosts with limited links,
and the MLPerf Training rows it is held against.

- `plan_check.py`: tfscale-plan against real runs (network-namespace hosts, tc
  links)
- `mlperf_rows.py`: MLPerf Training results as planning/published.json holds
  them
"""
