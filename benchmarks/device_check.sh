#!/usr/bin/env bash
# The accelerator session's one command: kernel tests with compiled kernels, kernels against
# their references, decode attention against the bandwidth, the roofline; one report file.
#   bash benchmarks/device_check.sh [REPORT.md]      (default: device_check.md)
# Runs end to end without an accelerator too (toy sizes; what needs one is skipped and said).
set -uo pipefail
cd "$(dirname "$0")/.."
exec python -m benchmarks.device_check "$@"
