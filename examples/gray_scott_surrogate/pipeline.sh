#!/usr/bin/env bash
# The surrogate pipeline (docs/tutorial.md), end to end on local ranks:
#   1. simulate   a Gray-Scott run (the training data), sharded over 2 ranks
#   2. pairs      (state, state K steps later) cut from its snapshots
#   3. train      the 3-d U-Net exported from PyTorch (unet3d.py -> unet3d.onnx) on random crops
#                 of an eighth of the grid (half of each side), on dp 2 x domain 2
#   4. simulate   a second run, another seed: the test data
#   5. infer      the trained network on the whole test grid (8x the cells of a training crop),
#                 on a 2x2 domain mesh
#   6. compare    the forecast with the simulation, beside the persistence forecast (no change)
#   7. plot       the losses and slices of truth and forecast
# Usage: pipeline.sh [OUT_DIR]  (default: surrogate-run). Sizes from the environment:
#   SIZE (grid side, default 64; training crops SIZE/2), STEPS (simulation steps, 400), EVERY
#   (K, 20), TRAIN_STEPS (200), BATCH (4), TESSERA (the binary, default build/apps/tessera).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tessera=${TESSERA:-$root/build/apps/tessera}
out=${1:-surrogate-run}
size=${SIZE:-64} steps=${STEPS:-400} every=${EVERY:-20}
train_steps=${TRAIN_STEPS:-200} batch=${BATCH:-4}
crop=$((size / 2))
mkdir -p "$out/plots"
stage() { printf '\n== %s\n' "$*"; }
t0=$(date +%s.%N)
seconds() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }

stage "1. simulate: ${size}^3, $steps steps, a snapshot every $every (2 ranks, x split)"
"$tessera" simulate gray-scott --size "$size" --steps "$steps" --every "$every" --seed 1 \
  --mesh 2 --shard-dims 0 --out "$out/train_run.h5" --json > "$out/simulate_train.json"
tail -n 1 "$out/simulate_train.json"

stage "2. pairs: (snapshot t, snapshot t+1) = (state, state $every steps later)"
"$tessera" convert "$out/train_run.h5:/snapshots[:-1]" "$out/pairs.h5:/x" --mesh 2 --shard-dims 2
"$tessera" convert "$out/train_run.h5:/snapshots[1:]" "$out/pairs.h5:/y" --mesh 2 --shard-dims 2

stage "3. train: the U-Net from unet3d.py (ONNX), $train_steps Adam steps of batch $batch, ${crop}^3 crops, dp 2 x domain 2"
"$tessera" train --model "$here/unet3d.onnx" --data "$out/pairs.h5" --input /x --target /y \
  --steps "$train_steps" --batch "$batch" --loss mse --optimizer adam --lr 5e-4 \
  --crop "$crop,$crop,$crop" --shuffle 1 --seed 1 --dp 2 --mesh 2 --shard-dims 2 \
  --losses-out "$out/losses.json" --save-model "$out/unet3d_trained.onnx" --plot "$out/plots" \
  --json > "$out/train.json"
tail -n 1 "$out/train.json"

stage "4. simulate: the test run, ${size}^3, another seed (2x2 ranks)"
"$tessera" simulate gray-scott --size "$size" --steps "$steps" --every "$every" --seed 2 \
  --mesh 2x2 --shard-dims 0,1 --out "$out/test_run.h5" --json > "$out/simulate_test.json"
tail -n 1 "$out/simulate_test.json"
"$tessera" convert "$out/test_run.h5:/snapshots[:-1]" "$out/test_in.h5:/x" --mesh 2x2 --shard-dims 3,4

stage "5. infer: the trained network on the whole ${size}^3 grid (8x a training crop), 2x2 domain mesh"
"$tessera" infer --model "$out/unet3d_trained.onnx" --in "$out/test_in.h5" --out "$out/forecast.h5" \
  --mesh 2x2 --shard-dims 3,4 --json > "$out/infer.json"
tail -n 1 "$out/infer.json"

stage "6. compare with the simulation (every test snapshot but the first)"
"$tessera" compare "$out/test_run.h5:/snapshots[1:]" "$out/forecast.h5:/y" --mesh 2x2 --shard-dims 3,4 \
  --json > "$out/error_forecast.json"
"$tessera" compare "$out/test_run.h5:/snapshots[1:]" "$out/test_run.h5:/snapshots[:-1]" --mesh 2x2 \
  --shard-dims 3,4 --json > "$out/error_persistence.json"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
forecast = json.load(open(f"{out}/error_forecast.json"))
persistence = json.load(open(f"{out}/error_persistence.json"))
print(f"relative L2 error, trained U-Net: {forecast['relative_l2_error']:.4g} "
      f"(rms {forecast['rms_error']:.3g}, max {forecast['max_abs_error']:.3g})")
print(f"relative L2 error, persistence (no change): {persistence['relative_l2_error']:.4g} "
      f"(rms {persistence['rms_error']:.3g}, max {persistence['max_abs_error']:.3g})")
print(f"the U-Net's error is {forecast['rms_error'] / persistence['rms_error']:.3f}x persistence's")
PY

stage "7. plots"
last=$(( steps / every - 1 ))
"$tessera" plot slice "$out/test_run.h5:/snapshots" --index "$((last + 1)),1" --axis z --at 0.5 \
  --out "$out/plots/truth_v.png"
"$tessera" plot slice "$out/forecast.h5:/y" --index "$last,1" --axis z --at 0.5 --out "$out/plots/forecast_v.png"
"$tessera" plot losses "$out/losses.json" --out "$out/plots/loss.png"
echo "plots in $out/plots: loss.png, truth_v.png, forecast_v.png"
printf '\npipeline done in %s s; files in %s\n' "$(seconds "$t0")" "$out"
