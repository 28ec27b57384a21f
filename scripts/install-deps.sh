#!/usr/bin/env bash
# Installs the Debian packages Tessera builds and tests with, skipping any already present.
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
# TESSERA_MPI=mpich (default) or openmpi picks the MPI and the parallel HDF5 built for it
# (libhdf5-mpich-dev or libhdf5-openmpi-dev: an HDF5 built for another MPI cannot be used).
# Adding a second MPI keeps the system's default MPI (update-alternatives) as it was.
set -euo pipefail

mpi=${TESSERA_MPI:-mpich}
case $mpi in
  mpich) mpi_packages=(mpich libmpich-dev libhdf5-mpich-dev) ;;
  openmpi) mpi_packages=(openmpi-bin libopenmpi-dev libhdf5-openmpi-dev) ;;
  *)
    echo "[install-deps] TESSERA_MPI=$mpi: expected mpich or openmpi" >&2
    exit 2
    ;;
esac

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev
  "${mpi_packages[@]}" hdf5-tools
  libdnnl-dev
  libonnx-dev libprotobuf-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libplplot-dev plplot-driver-cairo libpng-dev
  python3 python3-numpy python3-h5py python3-onnx
)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "[install-deps] all packages present"
  exit 0
fi

echo "[install-deps] installing: ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
# The MPI and HDF5 defaults (mpicc, mpiexec, h5pcc, ...) chosen before, restored afterwards: a
# newly installed MPI would otherwise take them over in "auto" mode.
alternatives=$(update-alternatives --get-selections 2>/dev/null | grep -E '^(mpi|mpirun|mpi-[^ ]*|h5pcc|hdf5\.pc) ' || true)
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
while read -r name _ target; do
  # An if, not `[ ] && ...`: with nothing to restore the loop must not end on a false test,
  # which set -e would take as the script failing after a successful install.
  if [ -n "$name" ]; then
    "${sudo_cmd[@]}" update-alternatives --set "$name" "$target" > /dev/null
  fi
done <<< "$alternatives"
