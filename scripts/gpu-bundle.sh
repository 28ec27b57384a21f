#!/usr/bin/env bash
# Packs what a bare GPU machine lacks into .gpu-deps/, an ignored folder that travels with the
# working tree to the device machine, where scripts/gpu-check.sh finds it. Run it here once
# before a GPU session:
#   scripts/gpu-bundle.sh                       build dependencies only (fmt, GoogleTest/GoogleMock,
#                                               nlohmann-json, CLI11: headers, libraries, CMake files)
#   scripts/gpu-bundle.sh --prebuilt [BUILD]    also a CUDA build made here (default: build/), so the
#                                               device spends no minutes compiling
# The prebuilt pack (.gpu-deps/prebuilt.tar.xz) holds the tessera program, every binary of the
# tests labelled gpu, the CTest files, and the shared libraries those need beyond the C and C++
# runtimes and CUDA's own (MPI, HDF5, oneDNN, ONNX, fmt...); the device keeps only those of them
# that it lacks. Its paths are absolute (CTest files, fixture folders), so .gpu-deps/prebuilt.root
# records this checkout's path and gpu-check.sh links the device's copy there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
prebuilt=
if [ "${1:-}" = "--prebuilt" ]; then
  prebuilt=$(cd "${2:-$root/build}" && pwd)
elif [ $# -gt 0 ]; then
  echo "gpu-bundle: unknown argument '$1' (see the header of $0)" >&2; exit 2
fi
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

if [ -n "$prebuilt" ]; then
  grep -q '^#define TESSERA_HAVE_CUDA 1' "$prebuilt/generated/core/config.hpp" 2>/dev/null || {
    echo "gpu-bundle: $prebuilt is not a CUDA build" >&2; exit 2; }
  [ -x "$prebuilt/apps/tessera" ] || { echo "gpu-bundle: $prebuilt/apps/tessera is not built" >&2; exit 2; }
  case "$prebuilt" in "$root"/*) ;; *) echo "gpu-bundle: $prebuilt is not inside $root" >&2; exit 2 ;; esac
  rel=${prebuilt#"$root"/}
  binaries=("$prebuilt/apps/tessera")
  for binary in "$prebuilt"/tests/tessera_gpu_*; do [ -x "$binary" ] && binaries+=("$binary"); done
  # The MPI launcher the build was configured with (its CTest files name it), when it is MPICH's
  # Hydra: the device's mpiexec may be another MPI's, which cannot start our MPICH programs.
  # gpu-check.sh points the CTest files at this copy (prebuilt.mpiexec names the original path).
  mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$prebuilt/CMakeCache.txt" 2>/dev/null || true)
  rm -rf "$prebuilt/gpu-bin"
  if [ -n "$mpiexec" ] && [ "$(basename "$(readlink -f "$mpiexec")")" = mpiexec.hydra ]; then
    mkdir -p "$prebuilt/gpu-bin"
    hydra_dir=$(dirname "$(readlink -f "$mpiexec")")
    cp -L "$hydra_dir/mpiexec.hydra" "$hydra_dir/hydra_pmi_proxy" "$prebuilt/gpu-bin/"
    binaries+=("$prebuilt/gpu-bin/mpiexec.hydra" "$prebuilt/gpu-bin/hydra_pmi_proxy")
  fi
  # Shared libraries outside the C/C++ runtimes and CUDA (the device has its own of those).
  libs="$prebuilt/gpu-libs"
  rm -rf "$libs"; mkdir -p "$libs"
  for binary in "${binaries[@]}"; do ldd "$binary"; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r soname path; do
      case "$soname" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) continue ;;
        libcuda*|libcudnn*|libnccl*|libcublas*|libcufft*|libcurand*|libnvrtc*|libnvJitLink*) continue ;;
      esac
      cp -L "$path" "$libs/$soname"
    done
  files=("${binaries[@]#"$root"/}" "$rel/gpu-libs")
  echo "${mpiexec:-}" >"$root/.gpu-deps/prebuilt.mpiexec"
  while IFS= read -r f; do files+=("${f#"$root"/}"); done < <(find "$prebuilt" -name CTestTestfile.cmake)
  echo "[gpu-bundle] packing ${#binaries[@]} programs and $(ls "$libs" | wc -l) libraries from $rel/"
  # One large LZMA window: the test programs share most of their code, so each after the first
  # costs little.
  tar -C "$root" -cf - "${files[@]}" | xz -T1 -9 --lzma2=dict=192MiB >"$root/.gpu-deps/prebuilt.tar.xz"
  echo "$root" >"$root/.gpu-deps/prebuilt.root"
  echo "$rel" >"$root/.gpu-deps/prebuilt.build"
  git -C "$root" rev-parse HEAD >"$root/.gpu-deps/prebuilt.commit"
  rm -rf "$libs" "$prebuilt/gpu-bin"
fi
du -sh "$root/.gpu-deps" | awk '{print "[gpu-bundle] .gpu-deps/: " $1}'
