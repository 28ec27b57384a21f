#!/usr/bin/env bash
# The GPU acceptance in one command, for a bare machine with an NVIDIA GPU:
#   scripts/gpu-check.sh [--out DIR] [--stages probe,build,test,sanitize,bench] [--full-suite]
# probe     where CUDA, cuDNN, NCCL, MPI, HDF5 and PyTorch live (cuDNN and NCCL may exist only
#           as the Python wheels' include/lib folders); written to DIR/probe.json
# build     configures build-gpu/ with Ninja (CUDA on; MPI, HDF5, oneDNN when found) and builds;
#           build dependencies missing on the machine come from .gpu-deps/ (scripts/gpu-bundle.sh)
# test      every test labelled gpu (and with --full-suite the whole CTest suite)
# sanitize  compute-sanitizer memcheck and racecheck on every gpu test binary
# bench     bench conv / bench na / bench comm on cuda beside PyTorch (apps/bench/torch_conv_bench.py,
#           apps/bench/torch_na_bench.py --impl flex), and
#           the machine's ceilings (device-to-device copy bandwidth, bf16 matrix product)
# Logs, one JSON (gpu-check.json) and one markdown report (gpu-check.md) go to DIR (default
# $OUT when set, else ./gpu-check-out). Stages run in the order above; the build folder is
# kept, so a later call can run the remaining stages. Exit status: 0 when every stage run passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-check-out}
stages=probe,build,test,sanitize,bench
full_suite=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --full-suite) full_suite=1; shift ;;
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
  export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
link_unversioned "$cudnn_lib" cudnn
link_unversioned "$nccl_lib" nccl

if want probe; then
  start=$SECONDS
  {
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== nvcc"; nvcc --version || true
    echo "== cmake / ninja"; cmake --version | head -n 1; ninja --version
    echo "== python / torch"
    [ -n "$python" ] && "$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))" || true
    echo "== compute-sanitizer"; command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer || true
  } >"$logs/probe.log" 2>&1
  "$python" - "$logs/probe.json" <<PY
import json, sys
json.dump({"cudnn_header": "$cudnn_header", "cudnn_lib": "$cudnn_lib",
           "nccl_header": "$nccl_header", "nccl_lib": "$nccl_lib",
           "mpiexec": "$mpiexec_path", "h5cc": "$h5cc_path"}, open(sys.argv[1], "w"), indent=1)
PY
  record probe pass $((SECONDS - start)) "cudnn=${cudnn_header:+found} nccl=${nccl_header:+found} mpi=${mpiexec_path:+found} hdf5=${h5cc_path:+found}"
fi

# --- build ---------------------------------------------------------------------------------
if want build; then
  start=$SECONDS
  prefix_path=
  if [ -d "$root/.gpu-deps/root/usr" ]; then
    prefix_path="$root/.gpu-deps/root/usr"
    export LD_LIBRARY_PATH="$prefix_path/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_WITH_CUDA=ON
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$prefix_path")
  [ -n "$cudnn_header" ] && args+=(-DCUDNN_INCLUDE_DIR="$(dirname "$cudnn_header")" -DCUDNN_LIBRARY="$links/libcudnn.so")
  [ -n "$nccl_header" ] && args+=(-DNCCL_INCLUDE_DIR="$(dirname "$nccl_header")" -DNCCL_LIBRARY="$links/libnccl.so")
  if cmake "${args[@]}" >"$logs/configure.log" 2>&1 &&
     cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1; then
    record build pass $((SECONDS - start)) "$(grep -o 'Tessera [0-9.]*: .*' "$logs/configure.log" | head -n 1)"
  else
    record build fail $((SECONDS - start)) "see configure.log / build.log"
    tail -n 40 "$logs/build.log" "$logs/configure.log" 2>/dev/null
  fi
fi
[ -d "$root/.gpu-deps/root/usr" ] &&
  export LD_LIBRARY_PATH="$root/.gpu-deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpu_test_binaries() {  # the executables of the tests labelled gpu
  ctest --test-dir "$build" -L gpu --show-only=json-v1 2>/dev/null | "$python" -c '
import json, sys
seen = []
for test in json.load(sys.stdin).get("tests", []):
    command = test.get("command") or []
    if command and command[0] not in seen:
        seen.append(command[0]); print(command[0])'
}

# --- test ----------------------------------------------------------------------------------
if want test; then
  start=$SECONDS
  if ctest --test-dir "$build" -L gpu --output-on-failure --timeout 600 \
       --output-junit "$logs/gpu-tests.xml" >"$logs/gpu-tests.log" 2>&1; then
    record test pass $((SECONDS - start)) "$(grep -E 'tests passed' "$logs/gpu-tests.log" | tail -n 1)"
  else
    record test fail $((SECONDS - start)) "$(grep -E 'tests passed|tests failed' "$logs/gpu-tests.log" | tail -n 1)"
  fi
  # The main job on the GPU: layouts, the conv network step and attention, checked vs one rank.
  start=$SECONDS
  if "$build/apps/tessera" demo --device cuda >"$logs/demo-cuda.log" 2>&1; then
    record demo-cuda pass $((SECONDS - start)) "$(grep -c ': yes' "$logs/demo-cuda.log") checks yes"
  else
    record demo-cuda fail $((SECONDS - start)) "$(tail -n 1 "$logs/demo-cuda.log")"
  fi
  if [ "$full_suite" = 1 ]; then
    start=$SECONDS
    if ctest --test-dir "$build" -LE gpu --output-on-failure -j 8 >"$logs/full-suite.log" 2>&1; then
      record full-suite pass $((SECONDS - start)) "$(grep -E 'tests passed' "$logs/full-suite.log" | tail -n 1)"
    else
      record full-suite fail $((SECONDS - start)) "$(grep -E 'tests passed|tests failed' "$logs/full-suite.log" | tail -n 1)"
    fi
  fi
fi

# --- sanitize ------------------------------------------------------------------------------
if want sanitize; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    start=$SECONDS
    errors=0
    for binary in $(gpu_test_binaries); do
      log="$logs/sanitize-$tool-$(basename "$binary").log"
      "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 "$binary" >"$log" 2>&1
      code=$?
      found=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | grep -oE '[0-9]+' | tail -n 1)
      [ "$code" -ne 0 ] && errors=$((errors + ${found:-1}))
    done
    if [ "$errors" -eq 0 ]; then
      record "sanitize-$tool" pass $((SECONDS - start)) "0 errors"
    else
      record "sanitize-$tool" fail $((SECONDS - start)) "$errors error(s)"
    fi
  done
fi

# --- bench ---------------------------------------------------------------------------------
if want bench; then
  start=$SECONDS
  tessera="$build/apps/tessera"
  ok=1
  "$python" "$root/scripts/gpu_ceilings.py" --json "$logs/ceilings.json" >"$logs/ceilings.log" 2>&1 || ok=0
  for dtype in f32 bf16; do
    # Each benchmark prints its table to the log and, with --json, its rows to the JSON file.
    "$tessera" bench conv --device cuda --dtype "$dtype" >"$logs/bench-conv-$dtype.log" 2>&1 || ok=0
    "$tessera" bench conv --device cuda --dtype "$dtype" --json >"$logs/bench-conv-$dtype.json" \
      2>>"$logs/bench-conv-$dtype.log" || ok=0
    "$tessera" bench conv --device cuda --dtype "$dtype" --no-comm --json \
      >"$logs/bench-conv-nocomm-$dtype.json" 2>>"$logs/bench-conv-$dtype.log" || ok=0
    "$python" "$root/apps/bench/torch_conv_bench.py" --device cuda --dtype "$dtype" --json \
      >"$logs/torch-conv-$dtype.json" 2>"$logs/torch-conv-$dtype.log" || ok=0
  done
  # Neighborhood attention on the GPU (1 rank and 4 local ranks sharing it) beside flex_attention.
  "$tessera" bench na --device cuda --dtype bf16 --ranks 1,4 --json >"$logs/bench-na-bf16.json" \
    2>"$logs/bench-na-bf16.log" || ok=0
  "$python" "$root/apps/bench/torch_na_bench.py" --impl flex --dtype bf16 --json \
    >"$logs/torch-na-bf16.json" 2>"$logs/torch-na-bf16.log" || ok=0
  "$tessera" bench comm --device cuda --json >"$logs/bench-comm.json" 2>"$logs/bench-comm.log" || ok=0
  if [ "$ok" = 1 ]; then record bench pass $((SECONDS - start)) "figures in bench-*.json"
  else record bench fail $((SECONDS - start)) "see bench-*.log"; fi
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
print(open(os.path.join(out, "gpu-check.md")).read())
PY
failed=0
grep -q $'\tfail\t' "$status_file" && failed=1
tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
exit "$failed"
