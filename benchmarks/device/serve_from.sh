#!/usr/bin/env bash
# `conduit serve` from the source tree in $CODE (default: this checkout), for `loadgen ab --server-cmd`:
# each variant names its tree with `--variant-env NAME CODE=DIR`, so two commits run side by side in one
# call (python -m puts the working directory first on sys.path, ahead of PYTHONPATH).
set -euo pipefail
cd "${CODE:-.}"
exec "${PYTHON:-python}" -m runtime.cli serve "$@"
