#!/usr/bin/env bash
# Moved to benchmarks/gpu/bert.sh; this name goes in the next release.
echo "benchmarks/gpu_bert.sh is now benchmarks/gpu/bert.sh; the old name goes in the next release" >&2
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu/bert.sh" "$@"
