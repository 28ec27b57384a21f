#!/usr/bin/env bash
# Builds Tessera with Open MPI and the parallel HDF5 built for it in its own folder
# (build-openmpi, or TESSERA_OPENMPI_BUILD_DIR) and runs the test suite there, mpiexec runs
# included (ctest label `openmpi` marks those). Works where MPICH is the system default: Open MPI
# is named explicitly (mpicxx.openmpi, mpiexec.openmpi, h5pcc.openmpi), nothing system-wide is
# switched. Installs Open MPI and libhdf5-openmpi-dev first when missing.
#   scripts/test-openmpi.sh [ctest arguments...]     e.g. scripts/test-openmpi.sh -L openmpi
# TESSERA_OPENMPI_CONFIGURE adds cmake arguments (CUDA is off by default: this run is about MPI);
# TESSERA_OPENMPI_TARGETS (space-separated) builds only those targets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${TESSERA_OPENMPI_BUILD_DIR:-$root/build-openmpi}

TESSERA_MPI=openmpi "$root/scripts/install-deps.sh"
for tool in mpicc.openmpi mpicxx.openmpi mpiexec.openmpi h5pcc.openmpi; do
  command -v "$tool" > /dev/null || { echo "[test-openmpi] $tool not found" >&2; exit 2; }
done

launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ ! -f "$build_dir/build.ninja" ]; then
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
    -DTESSERA_WITH_CUDA=OFF -DTESSERA_WITH_NCCL=OFF \
    -DTESSERA_WITH_MPI=ON -DTESSERA_WITH_HDF5=ON \
    -DMPI_C_COMPILER="$(command -v mpicc.openmpi)" \
    -DMPI_CXX_COMPILER="$(command -v mpicxx.openmpi)" \
    -DMPIEXEC_EXECUTABLE="$(command -v mpiexec.openmpi)" \
    -DHDF5_C_COMPILER_EXECUTABLE="$(command -v h5pcc.openmpi)" \
    ${TESSERA_OPENMPI_CONFIGURE:-}
fi
targets=()
for target in ${TESSERA_OPENMPI_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"

# Exactly one MPI library in the binaries: Open MPI's libmpi.so.40, never MPICH's libmpich.
for binary in "$build_dir/tests/tessera_dist_tests" "$build_dir/apps/tessera"; do
  [ -f "$binary" ] || continue
  if ldd "$binary" | grep -q libmpich; then
    echo "[test-openmpi] $binary links MPICH's libmpich as well as Open MPI" >&2
    exit 1
  fi
done

# Open MPI in a container: no oversubscription complaints, no attempt to use the network for
# local ranks (shared memory and loopback TCP only).
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=lo
export OMPI_MCA_oob_tcp_if_include=lo
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" "$@"
