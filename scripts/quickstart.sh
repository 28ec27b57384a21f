#!/usr/bin/env bash
# Quick start, step 1: installs whatever is missing, builds Tessera, and runs the main job
# (`tessera demo` on 4 local ranks: the `local` backend, no launcher needed).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
"${TESSERA_BUILD_DIR:-$root/build}/apps/tessera" demo
