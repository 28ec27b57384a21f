#!/usr/bin/env bash
# Installs the Debian packages Tessera builds and tests with, skipping any already present.
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev
  mpich libmpich-dev
  libhdf5-mpich-dev hdf5-tools
  libdnnl-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  python3 python3-numpy python3-h5py
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
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
