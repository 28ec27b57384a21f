#!/usr/bin/env bash
# Quick start, step 1: installs whatever is missing, builds Tessera, and runs the main job: the
# surrogate pipeline (examples/gray_scott_surrogate/pipeline.sh, docs/tutorial.md) on local ranks
# (the `local` backend, no launcher needed): simulate, train a U-Net exported from PyTorch on
# dp x domain, infer on a larger grid, compare with the simulation, plot. About a minute on 2
# cores after the build; its files go to build/surrogate-run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TESSERA_BUILD_DIR:-$root/build}
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
TESSERA="$build/apps/tessera" "$root/examples/gray_scott_surrogate/pipeline.sh" "$build/surrogate-run"
