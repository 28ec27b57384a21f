#!/usr/bin/env bash
# Packs the build dependencies that a bare GPU machine lacks (fmt, GoogleTest/GoogleMock,
# nlohmann-json, CLI11: Debian's headers, libraries and CMake package files) into .gpu-deps/,
# an ignored folder that travels with the working tree to the device machine, where
# scripts/gpu-check.sh finds it. Run it here once before a GPU session.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.gpu-deps/root"
packages=(libfmt-dev libfmt9 libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev)
"$root/scripts/install-deps.sh" >/dev/null
rm -rf "$root/.gpu-deps"
mkdir -p "$dest"
for pkg in "${packages[@]}"; do
  dpkg -L "$pkg" | while read -r path; do
    case "$path" in /usr/share/doc/*|/usr/share/man/*|/usr/src/*) continue ;; esac
    if [ -f "$path" ] || [ -L "$path" ]; then
      mkdir -p "$dest$(dirname "$path")"
      cp -a "$path" "$dest$path"
    fi
  done
done
du -sh "$root/.gpu-deps" | awk '{print "[gpu-bundle] .gpu-deps/: " $1}'
