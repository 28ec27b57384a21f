#!/usr/bin/env bash
# Sanitizer run: builds Tessera with AddressSanitizer + UndefinedBehaviorSanitizer (`address`, the
# default) or ThreadSanitizer (`thread`) in its own folder (build-asan, build-tsan; or
# TESSERA_SANITIZE_BUILD_DIR) and runs the test suite there. Any finding fails the run.
#   scripts/sanitize.sh [address|thread] [ctest arguments...]
#   e.g. scripts/sanitize.sh address -L 'unit|dist' -LE mpi      (what CI runs)
#        scripts/sanitize.sh address -R tessera_cli_io_fuzz      (the fuzz check under ASan)
# TESSERA_SANITIZE_TARGETS (space-separated) builds only those targets instead of everything.
# Builds without CUDA (no GPU code runs under a sanitizer); the thread build also turns OpenMP
# and oneDNN off (their thread pools are not instrumented, so TSan would report their internals).
# Leaks inside third-party libraries (MPICH/UCX, Open MPI, HDF5, oneDNN) are suppressed by
# scripts/sanitize/lsan.supp; nothing of Tessera's own is.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kind=address
if [ $# -gt 0 ] && { [ "$1" = address ] || [ "$1" = thread ]; }; then
  kind=$1
  shift
fi

configure=(-DTESSERA_SANITIZE="$kind" -DTESSERA_WITH_CUDA=OFF -DTESSERA_WITH_NCCL=OFF)
case $kind in
  address) build_dir=${TESSERA_SANITIZE_BUILD_DIR:-$root/build-asan} ;;
  thread)
    build_dir=${TESSERA_SANITIZE_BUILD_DIR:-$root/build-tsan}
    configure+=(-DTESSERA_WITH_OPENMP=OFF -DTESSERA_WITH_DNNL=OFF)
    ;;
esac

launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ ! -f "$build_dir/build.ninja" ]; then
  # -O1 with line tables: readable stacks, and much quicker to compile than -O2 -g.
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    "${launcher[@]}" "${configure[@]}"
fi
targets=()
for target in ${TESSERA_SANITIZE_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"

supp=$root/scripts/sanitize
# Halt on the first finding with a stack; leaks are checked at exit (ASan) with the third-party
# suppressions. MPICH's UCX intercepts mmap through hooks that the sanitizers' own interceptors
# break; UCX_MEM_MMAP_HOOK_MODE=none turns the hooks off (Open MPI ignores it).
# Tests launched with mpiexec also get fast_unwind_on_malloc=0 (tests/CMakeLists.txt): see there.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$supp/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp}
export UCX_MEM_MMAP_HOOK_MODE=none
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" "$@"
