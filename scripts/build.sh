#!/usr/bin/env bash
# Configures and builds Tessera in ./build (Release, Ninja). Extra arguments go to cmake's
# configure step, e.g. scripts/build.sh -DTESSERA_WITH_CUDA=OFF.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${TESSERA_BUILD_DIR:-$root/build}

if [ ! -f "$build_dir/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$build_dir" -j "$(nproc)"
