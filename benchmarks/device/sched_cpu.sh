#!/usr/bin/env bash
# docs/PERF.md "Scheduler planning cost (CPU)": the scheduler's host work per step with a null model
# (no torch forward, no GPU) at 1 / 64 / 256 / 1024 running requests. Runs on any machine, e.g. the
# project's CPU box (no .gpu needed). About 2 minutes.
#   PYTHON=.venv/bin/python bash benchmarks/device/sched_cpu.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results sched_cpu)
describe_machine "$dir"
$PY -m loadgen sched --json "$dir/sched.json" 2>&1 | tee "$dir/sched.txt"
