#!/usr/bin/env bash
# Quick start, step 2: the whole test suite (unit, local-backend distributed, mpiexec runs,
# package-consumer build; GPU tests skip without a GPU). Installs and builds first if needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
ctest --test-dir "${TESSERA_BUILD_DIR:-$root/build}" --output-on-failure -j "$(nproc)" "$@"
