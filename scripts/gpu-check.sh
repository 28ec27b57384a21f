#!/usr/bin/env bash
# The GPU acceptance in one command, for a bare machine with an NVIDIA GPU:
#   scripts/gpu-check.sh [--out DIR] [--stages probe,build,test,bench,sanitize] [--full-suite]
#                        [--deadline SECONDS] [--from-source]
# probe     where CUDA, cuDNN, NCCL, MPI, HDF5 and PyTorch live (cuDNN and NCCL may exist only
#           as the Python wheels' include/lib folders); written to DIR/probe.json
# build     the CUDA build made here and packed by `scripts/gpu-bundle.sh --prebuilt` when
#           .gpu-deps/prebuilt.tar.xz exists and its programs load (no compiling on the device);
#           else (or with --from-source) configures build-gpu/ with Ninja (CUDA on; MPI, HDF5,
#           oneDNN when found) and builds; build dependencies missing on the machine come from
#           .gpu-deps/ (scripts/gpu-bundle.sh)
# test      every test labelled gpu, all at once (and with --full-suite the whole CTest suite),
#           then `tessera demo --device cuda`
# bench     the machine's ceilings (device-to-device copy bandwidth, bf16 matrix product), then
#           bench conv / bench na / bench comm on cuda beside PyTorch
#           (apps/bench/torch_conv_bench.py, apps/bench/torch_na_bench.py --impl flex)
# sanitize  compute-sanitizer memcheck and racecheck on every gpu test binary, all at once; a run
#           cut by the deadline counts the errors it printed and the tests it finished (and a
#           test that fails under a tool is an error); hazards inside vendor kernels are reported
#           apart
# --deadline SECONDS: the whole check ends within SECONDS (each stage and command gets what is
# left, less 25 s to pack the logs), so a device call that must end by a limit returns its logs.
# Logs, one JSON (gpu-check.json) and one markdown report (gpu-check.md) go to DIR (default
# $OUT when set, else ./gpu-check-out). Stages run in the order above; the build folder is
# kept, so a later call can run the remaining stages. Exit status: 0 when every stage run passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-check-out}
stages=probe,build,test,bench,sanitize
full_suite=0
deadline=0
from_source=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --full-suite) full_suite=1; shift ;;
    --deadline) deadline=$2; shift 2 ;;
    --from-source) from_source=1; shift ;;
    *) echo "gpu-check: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
# Every log and figure goes to $logs; at the end they are packed into logs.tar.gz beside the two
# reports (a device machine sends back only a few files).
logs="$out/logs"
mkdir -p "$logs"
build="$root/build-gpu"
status_file="$logs/stages.tsv"
: >"$status_file"
want() { case ",$stages," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
record() {  # stage, status (pass|fail|skip), seconds, note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$status_file"
  echo "[gpu-check] $1: $2 ($3 s) $4"
}
python=$(command -v python3 || true)
# capped SECONDS command...: runs the command for at most SECONDS, less when the deadline (or the
# current stage's end, $stage_end) is nearer; exit 124 when cut, 125 when no time was left.
stage_end=0
capped() {
  local limit=$1; shift
  if [ "$deadline" -gt 0 ] && [ $((deadline - 25 - SECONDS)) -lt "$limit" ]; then
    limit=$((deadline - 25 - SECONDS)); fi
  if [ "$stage_end" -gt 0 ] && [ $((stage_end - SECONDS)) -lt "$limit" ]; then
    limit=$((stage_end - SECONDS)); fi
  if [ "$limit" -lt 5 ]; then echo "[gpu-check] no time left for: $*" >&2; return 125; fi
  timeout -k 5 "$limit" "$@"
}

# --- probe ---------------------------------------------------------------------------------
site_dirs() {
  [ -n "$python" ] && "$python" - <<'PY' 2>/dev/null
import site, sys
for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    print(p)
PY
}
find_first() {  # pattern, dirs...: the first existing file matching the glob pattern in dirs
  local pattern=$1; shift
  for dir in "$@"; do
    for f in $dir/$pattern; do [ -e "$f" ] && { echo "$f"; return 0; }; done
  done
  return 1
}
mapfile -t sites < <(site_dirs | sort -u)
cudnn_header=$(find_first cudnn.h /usr/include /usr/local/cuda/include /usr/include/x86_64-linux-gnu \
  "${sites[@]/%//nvidia/cudnn/include}" "${sites[@]/%//nvidia/cu13/include}") || cudnn_header=
cudnn_lib=$(find_first 'libcudnn.so*' /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 \
  "${sites[@]/%//nvidia/cudnn/lib}" "${sites[@]/%//nvidia/cu13/lib}") || cudnn_lib=
nccl_header=$(find_first nccl.h /usr/include /usr/local/cuda/include \
  "${sites[@]/%//nvidia/nccl/include}" "${sites[@]/%//nvidia/cu13/include}") || nccl_header=
nccl_lib=$(find_first 'libnccl.so*' /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 \
  "${sites[@]/%//nvidia/nccl/lib}" "${sites[@]/%//nvidia/cu13/lib}") || nccl_lib=
mpiexec_path=$(command -v mpiexec || true)
h5cc_path=$(command -v h5cc || command -v h5pcc || true)

# Libraries that exist only as versioned files (wheels ship libcudnn.so.9, libnccl.so.2) get an
# unversioned link in build-gpu/links so that CMake's find_library finds them.
links="$build/links"
mkdir -p "$links"
link_unversioned() {  # path-to-lib name
  [ -n "$1" ] || return 0
  local dir; dir=$(dirname "$1")
  local target; target=$(ls "$dir"/lib$2.so* 2>/dev/null | sort | head -n 1)
  [ -n "$target" ] && ln -sf "$target" "$links/lib$2.so"
  found_lib_path="$found_lib_path${found_lib_path:+:}$dir"
}
found_lib_path=
link_unversioned "$cudnn_lib" cudnn
link_unversioned "$nccl_lib" nccl

# The CUDA libraries our programs load (libcudart, libcublas, libcudnn, libnccl). PyTorch's wheels
# come first: their cuDNN and NCCL are the newest on such a machine (a prebuilt pack was compiled
# against a cuDNN newer than the system's), then the toolkit's, then what the probe found. Only our
# programs get this path (ours ..., env LD_LIBRARY_PATH="$our_ld"): PyTorch refuses a cuDNN older
# than its own, so it keeps finding its own through its RUNPATH.
cuda_lib_path=
for dir in "${sites[@]/%//nvidia/cudnn/lib}" "${sites[@]/%//nvidia/nccl/lib}" \
           "${sites[@]/%//nvidia/cu13/lib}" "${sites[@]/%//nvidia/cublas/lib}" \
           "${sites[@]/%//nvidia/cuda_runtime/lib}" \
           /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && cuda_lib_path="$cuda_lib_path${cuda_lib_path:+:}$dir"
done
our_ld="$cuda_lib_path${found_lib_path:+:$found_lib_path}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ours() { env LD_LIBRARY_PATH="$our_ld" "$@"; }

if want probe; then
  start=$SECONDS
  {
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== nvcc"; nvcc --version || true
    echo "== cmake / ninja"; cmake --version | head -n 1; ninja --version
    echo "== python / torch"
    [ -n "$python" ] && "$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))" || true
    echo "== compute-sanitizer"; command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer || true
    echo "== system"; head -n 2 /etc/os-release; nproc; ldd --version | head -n 1
    echo "== libraries"; ldconfig -p | grep -E 'cudnn|nccl|cublas|cudart|mpi|hdf5|dnnl' || true
    echo "== wheels"
    for site in "${sites[@]}"; do [ -d "$site/nvidia" ] && find "$site/nvidia" -maxdepth 3 -name 'lib*.so*'; done
    echo "== the libraries our programs load"; echo "$our_ld" | tr ':' '\n'
  } >"$logs/probe.log" 2>&1
  "$python" - "$logs/probe.json" <<PY
import json, sys
json.dump({"cudnn_header": "$cudnn_header", "cudnn_lib": "$cudnn_lib",
           "nccl_header": "$nccl_header", "nccl_lib": "$nccl_lib",
           "mpiexec": "$mpiexec_path", "h5cc": "$h5cc_path"}, open(sys.argv[1], "w"), indent=1)
PY
  record probe pass $((SECONDS - start)) "cudnn=${cudnn_header:+found} nccl=${nccl_header:+found} mpi=${mpiexec_path:+found} hdf5=${h5cc_path:+found}"
fi


# use_prebuilt: unpacks .gpu-deps/prebuilt.tar.xz (scripts/gpu-bundle.sh --prebuilt) where the
# build it came from lived, keeps the libraries this machine lacks, and checks that the programs
# load; sets $build. Returns 1 (with the reason in prebuilt.log) when they cannot be used.
use_prebuilt() {
  local pack="$root/.gpu-deps/prebuilt.tar.xz"
  [ -f "$pack" ] || { echo "no $pack"; return 1; }
  local origin rel
  origin=$(cat "$root/.gpu-deps/prebuilt.root") rel=$(cat "$root/.gpu-deps/prebuilt.build")
  echo "prebuilt from commit $(cat "$root/.gpu-deps/prebuilt.commit" 2>/dev/null) at $origin/$rel"
  # Its CTest files and compiled-in fixture folders name $origin: link this checkout there.
  if [ ! "$origin" -ef "$root" ]; then
    if [ -e "$origin" ] || [ -L "$origin" ]; then echo "$origin exists and is not this checkout"; return 1; fi
    mkdir -p "$(dirname "$origin")" && ln -s "$root" "$origin" || return 1
  fi
  tar -C "$root" -xJf "$pack" || return 1
  build="$origin/$rel"
  local lib name
  for lib in "$build"/gpu-libs/*; do
    name=$(basename "$lib")
    if ldconfig -p | grep -q "^[[:space:]]*$name "; then rm -f "$lib"; else echo "carried: $name"; fi
  done
  our_ld="$our_ld:$build/gpu-libs"
  # The CTest files' mpiexec was the build machine's (MPICH's Hydra, carried in gpu-bin/): this
  # machine's mpiexec may belong to another MPI, which cannot start our programs.
  local mpiexec
  mpiexec=$(cat "$root/.gpu-deps/prebuilt.mpiexec" 2>/dev/null || true)
  if [ -n "$mpiexec" ] && [ -x "$build/gpu-bin/mpiexec.hydra" ]; then
    find "$build" -name CTestTestfile.cmake -exec sed -i "s|\"$mpiexec\"|\"$build/gpu-bin/mpiexec.hydra\"|g" {} +
    export PATH="$build/gpu-bin:$PATH"
    echo "mpiexec: $mpiexec -> $build/gpu-bin/mpiexec.hydra"
  fi
  ours ldd "$build/apps/tessera" | grep 'not found' && return 1
  ours "$build/apps/tessera" --version || return 1
}

# --- build ---------------------------------------------------------------------------------
if want build; then
  start=$SECONDS
  if [ "$from_source" = 0 ] && use_prebuilt >"$logs/prebuilt.log" 2>&1; then
    record build pass $((SECONDS - start)) "prebuilt: $(head -n 1 "$logs/prebuilt.log")"
  else
    build="$root/build-gpu"
    prefix_path=
    if [ -d "$root/.gpu-deps/root/usr" ]; then
      prefix_path="$root/.gpu-deps/root/usr"
      export LD_LIBRARY_PATH="$prefix_path/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_WITH_CUDA=ON
          -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$prefix_path")
    [ -n "$cudnn_header" ] && args+=(-DCUDNN_INCLUDE_DIR="$(dirname "$cudnn_header")" -DCUDNN_LIBRARY="$links/libcudnn.so")
    [ -n "$nccl_header" ] && args+=(-DNCCL_INCLUDE_DIR="$(dirname "$nccl_header")" -DNCCL_LIBRARY="$links/libnccl.so")
    if capped 100000 cmake "${args[@]}" >"$logs/configure.log" 2>&1 &&
       capped 100000 cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1; then
      record build pass $((SECONDS - start)) "$(grep -o 'Tessera [0-9.]*: .*' "$logs/configure.log" | head -n 1)"
    else
      record build fail $((SECONDS - start)) "see prebuilt.log / configure.log / build.log"
      tail -n 40 "$logs/prebuilt.log" "$logs/build.log" "$logs/configure.log" 2>/dev/null
    fi
  fi
fi
[ -d "$root/.gpu-deps/root/usr" ] &&
  export LD_LIBRARY_PATH="$root/.gpu-deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! want build && [ -f "$root/.gpu-deps/prebuilt.build" ] && [ ! -d "$build" ]; then
  build="$(cat "$root/.gpu-deps/prebuilt.root")/$(cat "$root/.gpu-deps/prebuilt.build")"
  our_ld="$our_ld:$build/gpu-libs"
fi
our_ld="$our_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpu_test_binaries() {  # the executables of the tests labelled gpu
  ctest --test-dir "$build" -L gpu --show-only=json-v1 2>/dev/null | "$python" -c '
import json, sys
seen = []
for test in json.load(sys.stdin).get("tests", []):
    command = test.get("command") or []
    # The test programs themselves, not a launcher (mpiexec) that runs one.
    if command and command[0].rsplit("/", 1)[-1].startswith("tessera_") and command[0] not in seen:
        seen.append(command[0]); print(command[0])'
}

# --- test ----------------------------------------------------------------------------------
if want test; then
  start=$SECONDS
  stage_end=$((SECONDS + ${GPU_CHECK_TEST_SECONDS:-180}))
  # All at once: the GPU is shared by the binaries as by the local ranks inside each.
  # The tests' own TIMEOUTs outrank --timeout; --stop-time cuts them all at the stage's end.
  if [ "$deadline" -gt 0 ] && [ $((deadline - 40)) -lt "$stage_end" ]; then stage_end=$((deadline - 40)); fi
  stop=$(date -d "+$((stage_end - SECONDS - 10)) seconds" +%H:%M:%S)
  # GPU_CHECK_TEST_FILTER=REGEX: only the CTest entries it matches (a short rerun of a failure)
  if capped 100000 env LD_LIBRARY_PATH="$our_ld" ctest --test-dir "$build" -L gpu -j 16 \
       ${GPU_CHECK_TEST_FILTER:+-R "$GPU_CHECK_TEST_FILTER"} --output-on-failure --stop-time "$stop" --output-junit "$logs/gpu-tests.xml" \
       >"$logs/gpu-tests.log" 2>&1; then
    record test pass $((SECONDS - start)) "$(grep -E 'tests passed' "$logs/gpu-tests.log" | tail -n 1)"
  else
    record test fail $((SECONDS - start)) "$(grep -E 'tests passed|tests failed' "$logs/gpu-tests.log" | tail -n 1)"
  fi
  # rerun NAME SECONDS BINARY FILTER VAR=VALUE...: one test binary again under other settings,
  # its log (NAME without "test-")-tests.log, recorded as stage NAME.
  # GPU_CHECK_RERUNS=a,b,...: run only these reruns (none: GPU_CHECK_RERUNS=none).
  rerun() {
    local name=$1 seconds=$2 binary=$3 filter=$4
    shift 4
    if [ -n "${GPU_CHECK_RERUNS:-}" ]; then
      case ",$GPU_CHECK_RERUNS," in *",$name,"*) ;; *) return 0 ;; esac
    fi
    local log="$logs/${name#test-}-tests.log" start=$SECONDS
    if capped "$seconds" env LD_LIBRARY_PATH="$our_ld" "$@" "$build/tests/$binary" \
         --gtest_filter="$filter" >"$log" 2>&1; then
      record "$name" pass $((SECONDS - start)) "$(grep -E 'PASSED' "$log" | tail -n 1)"
    else
      record "$name" fail $((SECONDS - start)) "$(grep -E 'FAILED|PASSED' "$log" | head -n 3 | tr '\n' ' ')"
    fi
  }
  # The shared-memory (fused) kernels of neighborhood attention, kept beside the default
  # register-tiled (mma) ones: the sharded sweep of the tensor-core calls and the determinism
  # test again with them as the kernels the dispatch picks (the kernel comparisons NaGpu.Mma* and
  # NaGpu.Fused* ran in the suite above).
  rerun test-na-fused 90 tessera_gpu_na_tests 'NaGpu.ShardedFused*:NaGpu.Backward*' \
    TESSERA_NA_CUDA_KERNEL=fused
  # The whole na suite with the mma forward built for the registers the compiler allocates
  # (TESSERA_NA_MMA_FORWARD_BLOCKS=auto: 3 blocks per SM; the default is 4).
  rerun test-na-mma-auto 90 tessera_gpu_na_tests '*' TESSERA_NA_MMA_FORWARD_BLOCKS=auto
  # The conv tests again on cuDNN's legacy API (TESSERA_CUDNN_API=legacy; the graph API is the
  # default): fixtures, rounding bounds, determinism, the sharded sweep.
  rerun test-conv-legacy 120 tessera_gpu_conv_tests '-*OutOfMemory*' TESSERA_CUDNN_API=legacy
  stage_end=0
  # The main job on the GPU: layouts, the conv network step and attention, checked vs one rank.
  start=$SECONDS
  if capped 40 env LD_LIBRARY_PATH="$our_ld" "$build/apps/tessera" demo --device cuda \
       >"$logs/demo-cuda.log" 2>&1; then
    record demo-cuda pass $((SECONDS - start)) "$(grep -c ': yes' "$logs/demo-cuda.log") checks yes"
  else
    record demo-cuda fail $((SECONDS - start)) "$(tail -n 1 "$logs/demo-cuda.log")"
  fi
  if [ "$full_suite" = 1 ]; then
    start=$SECONDS
    if capped 100000 env LD_LIBRARY_PATH="$our_ld" ctest --test-dir "$build" -LE gpu \
         --output-on-failure -j 8 >"$logs/full-suite.log" 2>&1; then
      record full-suite pass $((SECONDS - start)) "$(grep -E 'tests passed' "$logs/full-suite.log" | tail -n 1)"
    else
      record full-suite fail $((SECONDS - start)) "$(grep -E 'tests passed|tests failed' "$logs/full-suite.log" | tail -n 1)"
    fi
  fi
fi

# --- bench ---------------------------------------------------------------------------------
if want bench; then
  start=$SECONDS
  stage_end=$((SECONDS + ${GPU_CHECK_BENCH_SECONDS:-200}))
  tessera=(env LD_LIBRARY_PATH="$our_ld" "$build/apps/tessera")
  failed_steps=
  step() {  # name seconds command...: one benchmark; its JSON (stdout) to NAME.json, log to NAME.log
    local name=$1 seconds=$2; shift 2
    # GPU_CHECK_BENCH_STEPS=a,b,...: run only these steps (a short rerun of what changed)
    if [ -n "${GPU_CHECK_BENCH_STEPS:-}" ]; then
      case ",$GPU_CHECK_BENCH_STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    fi
    capped "$seconds" "$@" >"$logs/$name.json" 2>"$logs/$name.log" || failed_steps="$failed_steps $name"
  }
  # In order of what the acceptance needs most, so that a short deadline drops the least.
  step ceilings 40 "$python" "$root/scripts/gpu_ceilings.py"
  step bench-na-bf16 60 "${tessera[@]}" bench na --device cuda --dtype bf16 --ranks 1,4 \
    --kernel 7,13,31 --reference-size 0 --json
  step torch-na-bf16 75 "$python" "$root/apps/bench/torch_na_bench.py" --impl flex --dtype bf16 \
    --kernel 7,13,31 --json
  # The 4-rank forward+backward traced (no Nsight Systems on the lent machines): each rank's
  # host time per op, halo step and copy, to say whether the 4 local ranks' fixed cost over one
  # rank is launches or waits (bench-na-bf16's rows give host_waits_per_step).
  mkdir -p "$logs/traces"  # not *.json in logs: the report reads those as benchmark results
  step bench-na-trace-bf16 30 "${tessera[@]}" bench na --device cuda --dtype bf16 --ranks 1,4 \
    --kernel 7 --reference-size 0 --iterations 5 --json --trace "$logs/traces/na.json"
  # The sharded forward with the halo overlap split (TESSERA_HALO_OVERLAP=1; off by default):
  # its 4-rank rows against bench-na-bf16's.
  step bench-na-overlap-bf16 40 env TESSERA_HALO_OVERLAP=1 "${tessera[@]}" bench na --device cuda \
    --dtype bf16 --ranks 4 --kernel 7,13,31 --reference-size 0 --json
  # The mma forward built for the registers the compiler allocates (3 blocks per SM; the default is 4).
  step bench-na-mma-auto-bf16 40 env TESSERA_NA_MMA_FORWARD_BLOCKS=auto "${tessera[@]}" bench na \
    --device cuda --dtype bf16 --ranks 1 --kernel 7,13,31 --reference-size 0 --json
  # cuDNN's measurements (every algorithm's workspace need and time, the choice) go to the log.
  for dtype in bf16 f32; do
    # The graph API times every candidate engine on each conv's first call: f32's 3-d filter
    # gradient takes seconds (docs/gpu.md), hence 90 s.
    step "bench-conv-$dtype" 90 env TESSERA_CUDNN_LOG=1 "${tessera[@]}" bench conv --device cuda \
      --dtype "$dtype" --json
    step "torch-conv-$dtype" 60 "$python" "$root/apps/bench/torch_conv_bench.py" --device cuda \
      --dtype "$dtype" --json
  done
  step bench-comm 30 "${tessera[@]}" bench comm --device cuda --json
  # The same convs on cuDNN's legacy API (the algorithms of cuDNN 7's enums, each timed).
  for dtype in f32 bf16; do
    step "bench-conv-legacy-$dtype" 60 env TESSERA_CUDNN_API=legacy TESSERA_CUDNN_LOG=1 \
      "${tessera[@]}" bench conv --device cuda --dtype "$dtype" --json
  done
  step bench-conv-nocomm-bf16 30 env TESSERA_CUDNN_LOG=1 "${tessera[@]}" bench conv --device cuda \
    --dtype bf16 --no-comm --json
  step bench-na-fused-bf16 60 env TESSERA_NA_CUDA_KERNEL=fused "${tessera[@]}" bench na \
    --device cuda --dtype bf16 --ranks 1,4 --kernel 7,13,31 --reference-size 0 --json
  # Nsight Compute on one forward and one backward launch of each neighborhood-attention family
  # (k 7, bf16, 256^2, 4 heads, D 64): speed of light, occupancy, the memory chart, warp stalls.
  ncu_path=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  if [ -n "$ncu_path" ]; then
    for family in fused mma; do
      step "ncu-na-$family" 45 env TESSERA_NA_CUDA_KERNEL=$family "$ncu_path" --clock-control none \
        --log-file "$logs/ncu-na-$family.txt" \
        --kernel-name 'regex:(fused|mma)_(forward|backward_query|backward_key)' --launch-skip 1 \
        --launch-count 9 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis \
        env LD_LIBRARY_PATH="$our_ld" "$build/apps/tessera" bench na --device cuda --dtype bf16 \
        --ranks 1 --kernel 7 --reference-size 0 --iterations 2
    done
    # Where the mma forward spends its issue slots at k 31 (the TFLOP/s target's case): the
    # instruction mix per pipe, the scheduler's eligible warps, and the SASS lines with the most
    # stall samples (SourceCounters), one launch.
    step ncu-na-mma-source 60 "$ncu_path" --clock-control none --log-file "$logs/ncu-na-mma-source.txt" \
      --kernel-name 'regex:mma_forward' --launch-skip 1 --launch-count 1 --section InstructionStats \
      --section SchedulerStats --section WarpStateStats --section SourceCounters \
      env LD_LIBRARY_PATH="$our_ld" "$build/apps/tessera" bench na --device cuda --dtype bf16 \
      --ranks 1 --kernel 31 --reference-size 0 --iterations 2
  fi
  stage_end=0
  if [ -z "$failed_steps" ]; then record bench pass $((SECONDS - start)) "figures in bench-*.json"
  else record bench fail $((SECONDS - start)) "failed or cut:$failed_steps"; fi
fi

# --- sanitize ------------------------------------------------------------------------------
# sanitize_summary LOG: errors the tool reported (its summary, else the error records it printed
# before the deadline cut it) and the tests that finished under it. API errors raised and handled
# inside NCCL are not counted: NCCL probes each of its kernels with cudaFuncGetAttributes at
# initialisation and skips those without an image for this GPU ("no kernel image is available",
# reported as "Program hit ..." with libnccl's frames first).
# Two kinds of record are counted apart from the errors: the tool's "Internal Sanitizer Error:
# Detected a failure to track a kernel launch" (third number: its records may be incomplete, no
# kernel erred), and racecheck hazards whose two accesses both lie outside our kernels (fourth
# number; every kernel of ours is in namespace tessera): cuDNN's Hopper implicit-GEMM kernels
# (sm90_xmma_*, warp-specialized, fed by TMA and mbarriers) report 20 such records at 16f329d,
# shared-memory hazards inside one vendor kernel that its arguments cannot cause. Every other
# internal error of the tool counts, and so does every test that failed under it.
sanitize_summary() {
  local log=$1 errors nccl lost vendor failed
  errors=$(grep -oE '(ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?)' "$log" |
           grep -oE '[0-9]+' | tail -n 1)
  [ -z "$errors" ] && errors=$(grep -cE '^========= (Invalid|Error|Uninitialized|Program hit|.*Race reported|Internal Sanitizer Error)' "$log")
  nccl=$(awk '/^========= Program hit/ { hit = 1; next }
              hit && /Host Frame:/ { if ($0 ~ /libnccl/) n++; hit = 0 }
              END { print n + 0 }' "$log")
  lost=$(grep -c '^========= Internal Sanitizer Error: Detected a failure to track a kernel launch' "$log")
  vendor=$(awk '/Race reported between/ { first = $0; getline; if (first !~ /tessera/ && $0 !~ /tessera/) n++ }
                END { print n + 0 }' "$log")
  failed=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")
  errors=$((errors - nccl - lost - vendor))
  [ "$errors" -lt 0 ] && errors=0
  echo "$((errors + failed)) $(grep -c '^\[       OK \]' "$log") $lost $vendor $failed"
}
if want sanitize; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  start=$SECONDS
  [ -x "$sanitizer" ] || { record sanitize fail 0 "compute-sanitizer not found"; stages=${stages/sanitize/}; }
fi
if want sanitize; then
  # Every binary under memcheck and under racecheck at once; what the deadline leaves is theirs.
  pids=()
  # GPU_CHECK_SANITIZE_TOOLS / GPU_CHECK_SANITIZE_FILTER (a regex of binary names): a short rerun
  for tool in ${GPU_CHECK_SANITIZE_TOOLS:-memcheck racecheck}; do
    for binary in $(gpu_test_binaries | grep -E "${GPU_CHECK_SANITIZE_FILTER:-.}"); do
      log="$logs/sanitize-$tool-$(basename "$binary").log"
      # The tests that provoke a CUDA error on purpose (out of memory) are left out: the tool
      # reports every failed API call as an error, expected or not.
      # The seeded sweeps run an eighth of their cases (GPU_CHECK_SANITIZE_SWEEP_DIVISOR): under
      # the tools every kernel runs 10-100x slower, and a whole sweep takes minutes.
      # GPU_CHECK_RACECHECK_EXCLUDE (a regex of kernel names, e.g.
      # 'cudnn|xmma|cutlass|cublas|nccl|gemm|gemv'): kernels racecheck leaves uninstrumented. Off
      # by default: with cuDNN's kernels left out (CUDA 13.0's tool, H200, 16f329d) its f16
      # backward-data convolution died of an illegal address the tool "failed to handle", where
      # the plain run, memcheck and racecheck over every kernel all ran it clean.
      exclude=()
      if [ "$tool" = racecheck ] && [ -n "${GPU_CHECK_RACECHECK_EXCLUDE:-}" ]; then
        exclude=(--kernel-name-exclude "regex=$GPU_CHECK_RACECHECK_EXCLUDE")
      fi
      TESSERA_TEST_SWEEP_DIVISOR="${GPU_CHECK_SANITIZE_SWEEP_DIVISOR:-8}" \
      TESSERA_BACKEND=local GTEST_FILTER="${GPU_CHECK_SANITIZE_GTEST:--*OutOfMemory*}" capped 100000 \
        env LD_LIBRARY_PATH="$our_ld" "$sanitizer" --tool "$tool" "${exclude[@]}" \
        --error-exitcode 99 --print-limit 20 "$binary" >"$log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for tool in ${GPU_CHECK_SANITIZE_TOOLS:-memcheck racecheck}; do
    errors=0 finished=0 cut=0 apart=""
    for log in "$logs"/sanitize-$tool-*.log; do
      [ -e "$log" ] || continue
      read -r e f i v x < <(sanitize_summary "$log")
      errors=$((errors + e)) finished=$((finished + f))
      whole=" (ran to the end)"
      grep -qE '(ERROR|RACECHECK) SUMMARY' "$log" || { cut=$((cut + 1)); whole=" (cut by the deadline)"; }
      extra=""
      [ "$x" -gt 0 ] && extra+="; $x test(s) failed under the tool"
      [ "$i" -gt 0 ] && extra+="; the tool lost track of $i kernel launch(es), its records may be incomplete"
      [ "$v" -gt 0 ] && extra+="; $v hazard record(s) inside vendor kernels only"
      [ -n "$extra" ] && apart+=" $(basename "$log" .log | sed 's/^sanitize-[a-z]*-//'):${extra#;}."
      echo "$tool $(basename "$log"): $e errors, $f tests finished$whole$extra" >>"$logs/sanitize-summary.txt"
    done
    if [ "$errors" -eq 0 ]; then
      record "sanitize-$tool" pass $((SECONDS - start)) "0 errors; $finished tests finished; $cut binaries cut by the deadline.$apart"
    else
      record "sanitize-$tool" fail $((SECONDS - start)) "$errors error(s); $finished tests finished; $cut binaries cut.$apart"
    fi
  done
fi

# --- report --------------------------------------------------------------------------------
"$python" - "$out" "$logs" <<'PY'
import glob, json, os, sys
out, logs = sys.argv[1], sys.argv[2]
stages = []
for line in open(os.path.join(logs, "stages.tsv")):
    name, status, seconds, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    stages.append({"stage": name, "status": status, "seconds": int(seconds or 0), "note": note})
report = {"stages": stages, "results": {}}
for path in sorted(glob.glob(os.path.join(logs, "*.json"))):
    name = os.path.basename(path)
    if name in ("gpu-check.json",):
        continue
    try:
        report["results"][name] = json.load(open(path))
    except Exception as error:  # a benchmark that died mid-write
        report["results"][name] = {"error": str(error)}
json.dump(report, open(os.path.join(out, "gpu-check.json"), "w"), indent=1)
with open(os.path.join(out, "gpu-check.md"), "w") as md:
    md.write("# GPU check\n\n| stage | status | seconds | note |\n|---|---|---|---|\n")
    for s in stages:
        md.write(f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['note']} |\n")
    # The sanitizer runs that reported errors or were cut (the rest ran to the end clean).
    summary = os.path.join(logs, "sanitize-summary.txt")
    if os.path.exists(summary):
        # A clean run's line ends "(ran to the end)"; others carry errors, notes or a cut.
        lines = [line.strip() for line in open(summary)
                 if ": 0 errors," not in line or not line.strip().endswith("(ran to the end)")]
        md.write("\n## Sanitizer runs with errors, notes or cut\n\n")
        md.write("".join(f"- {line}\n" for line in lines) if lines else "none\n")
    # Neighborhood attention: both kernel families beside flex_attention, 1 rank, per window.
    def rows_of(name):  # a benchmark's rows (none when it failed or did not run)
        data = report["results"].get(name) or {}
        return data.get("rows", []) if isinstance(data, dict) else []
    def na_rows(name):
        return {row.get("kernel"): row for row in rows_of(name) if row.get("ranks", 1) == 1}
    mma, fused, flex = (na_rows("bench-na-bf16.json"), na_rows("bench-na-fused-bf16.json"),
                        na_rows("torch-na-bf16.json"))
    mma_auto = na_rows("bench-na-mma-auto-bf16.json")  # TESSERA_NA_MMA_FORWARD_BLOCKS=auto
    windows = sorted(set(mma) | set(fused) | set(flex), key=lambda k: (k is None, k))
    if windows:
        md.write("\n## Neighborhood attention, bf16, 1 rank (ms; flex / ours = speedup)\n\n"
                 "| k | mma fwd | mma f+b | mma auto blocks/SM fwd | fused fwd | fused f+b | flex fwd |"
                 " flex f+b | flex/mma fwd | flex/mma f+b |\n"
                 "|---|---|---|---|---|---|---|---|---|---|\n")
        def ms(rows, k, key):
            value = rows.get(k, {}).get(key)
            return f"{value:.3f}" if isinstance(value, (int, float)) else "-"
        def ratio(k, key):
            a, b = flex.get(k, {}).get(key), mma.get(k, {}).get(key)
            return f"{a / b:.2f}x" if isinstance(a, (int, float)) and b else "-"
        for k in windows:
            md.write(f"| {k} | {ms(mma, k, 'forward_ms')} | {ms(mma, k, 'forward_backward_ms')} | "
                     f"{ms(mma_auto, k, 'forward_ms')} | {ms(fused, k, 'forward_ms')} | {ms(fused, k, 'forward_backward_ms')} | "
                     f"{ms(flex, k, 'forward_ms')} | {ms(flex, k, 'forward_backward_ms')} | "
                     f"{ratio(k, 'forward_ms')} | {ratio(k, 'forward_backward_ms')} |\n")
    # Neighborhood attention sharded: 4 local ranks sharing the GPU against 1 (the target: within
    # 1.15x), and the calls per forward+backward step that blocked a host thread on the device.
    sharded = {(row.get("kernel"), row.get("ranks")): row for row in rows_of("bench-na-bf16.json")}
    if any(ranks == 4 for _, ranks in sharded):
        md.write("\n## Neighborhood attention, bf16, 4 local ranks against 1 (ms)\n\n"
                 "| k | 1 rank fwd | 4 ranks fwd | 4 / 1 fwd | 1 rank f+b | 4 ranks f+b | 4 / 1 f+b |"
                 " host waits a step, 1 / 4 ranks |\n|---|---|---|---|---|---|---|---|\n")
        def cell(row, key, digits=3):
            value = row.get(key)
            return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"
        def over(a, b, key):
            x, y = a.get(key), b.get(key)
            return f"{x / y:.2f}x" if isinstance(x, (int, float)) and y else "-"
        for k in sorted({k for k, _ in sharded if k is not None}):
            one, four = sharded.get((k, 1), {}), sharded.get((k, 4), {})
            md.write(f"| {k} | {cell(one, 'forward_ms')} | {cell(four, 'forward_ms')} | "
                     f"{over(four, one, 'forward_ms')} | {cell(one, 'forward_backward_ms')} | "
                     f"{cell(four, 'forward_backward_ms')} | {over(four, one, 'forward_backward_ms')} | "
                     f"{cell(one, 'host_waits_per_step', 1)} / {cell(four, 'host_waits_per_step', 1)} |\n")
    # Convolution: graph (the default) and legacy API beside PyTorch, 1 rank (4 ranks: ours).
    def conv_rows(name, ranks=1):
        return {(tuple(r.get("shape", [])), r.get("kernel")): r for r in rows_of(name)
                if r.get("ranks", 1) == ranks}
    for dtype in ("bf16", "f32"):
        graph, legacy = conv_rows(f"bench-conv-{dtype}.json"), conv_rows(f"bench-conv-legacy-{dtype}.json")
        torch_rows, four = conv_rows(f"torch-conv-{dtype}.json"), conv_rows(f"bench-conv-{dtype}.json", 4)
        shapes = sorted(set(graph) | set(legacy) | set(torch_rows), key=str)
        if not shapes:
            continue
        md.write(f"\n## Convolution, {dtype} (ms, fwd / f+b)\n\n"
                 "| shape, k | graph | legacy | PyTorch | graph / PyTorch | legacy / PyTorch | 4 ranks graph |\n"
                 "|---|---|---|---|---|---|---|\n")
        def pair(rows, key):
            r = rows.get(key, {})
            f, b = r.get("forward_ms"), r.get("forward_backward_ms")
            return f"{f:.2f} / {b:.2f}" if isinstance(f, (int, float)) and isinstance(b, (int, float)) else "-"
        def over(rows, key):
            a, t = rows.get(key, {}), torch_rows.get(key, {})
            try:
                return (f"{a['forward_ms'] / t['forward_ms']:.2f}x / "
                        f"{a['forward_backward_ms'] / t['forward_backward_ms']:.2f}x")
            except (KeyError, TypeError, ZeroDivisionError):
                return "-"
        for key in shapes:
            md.write(f"| {','.join(map(str, key[0]))} k{key[1]} | {pair(graph, key)} | {pair(legacy, key)} | "
                     f"{pair(torch_rows, key)} | {over(graph, key)} | {over(legacy, key)} | {pair(four, key)} |\n")
print(open(os.path.join(out, "gpu-check.md")).read())
PY
failed=0
grep -q $'\tfail\t' "$status_file" && failed=1
tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
exit "$failed"
