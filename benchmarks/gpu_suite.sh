#!/usr/bin/env bash
# Every GPU measurement in one run, on the image's own python and torch, offline; writes a markdown report.
#
#   bash benchmarks/gpu_suite.sh [REPORT.md]            # on a GPU machine, from the repository root
#   bash benchmarks/gpu_suite.sh --quick [REPORT.md]    # CPU smoke test: tiny model, few steps, same commands
#   bash benchmarks/gpu_suite.sh --short [REPORT.md]    # a GPU lent for ~10 minutes: 1B, one round of 15 steps,
#       AC none/selective eager, AC none compiled (bf16 and fp8), a 50-step fp8 curve, the gpu tests; the CPU-only
#       gloo tests (fp16 scaler, 8 ranks) are left to CI
#
# Nothing is installed from a package index. The project is put on PYTHONPATH as it is; the few small packages an
# image lacks (jsonargparse, torchao: benchmarks/gpu_wheels.sh downloads them, about 4 MiB) are installed from the
# wheel folder $WHEELS (default .whl) into a temporary directory when it exists. A step whose package is absent is
# skipped with a line in the report; every step's wall time is recorded. The whole suite fits in 20 minutes on one
# H100 (1B model). Measures, in order (a failing step is recorded and the suite goes on):
#   1. benchmarks/mfu.py, 1B preset, bf16-mixed, seq 2048: AC none/selective x compile off/on, then fp8 (torchao)
#      (tokens/s, MFU vs the peak table = 989 TFLOP/s bf16 on H100 SXM/H200, peak memory, ratio vs raw loop)
#   2. the memory planner's estimate for the same runs (compare with the measured peak: >10% off = fix the tables)
#   3. benchmarks/fp8_loss_curve.py: fp8 vs bf16 over 200 steps, loss difference and tokens/s (torchao)
#   4. pytest -m gpu (bf16 parity, compile equality, fused AdamW, CUDA checkpoint resume, MFUMonitor, grouped
#      experts vs the loop, fp16 scaler + clipping with fused vs unfused AdamW, ShardedMuon vs torch's Muon, the
#      chunked cross-entropy in bf16 and its peak memory, the ring-attention kernels)
#   5. fp16 with a loss scaler against one process under ZeRO-3, TP, TP+SP and two pipeline schedules (gloo)
#   6. the 8-rank 3D parity tests (gloo on CPU cores; need >= 8 cores)
set -uo pipefail

ARGS="$*"
QUICK=0
SHORT=0
REPORT=gpu_results.md
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --short) SHORT=1 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) REPORT=$arg ;;
  esac
done
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
[ -f pyproject.toml ] && [ -d lightning_llm ] || { echo "run from the repository root" >&2; exit 2; }
LOG=$(mktemp -d)
if compgen -G "$WHEELS/*.whl" >/dev/null; then  # offline: the carried wheels only, never the index
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$LOG/site" "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH="$PWD${LOG:+:$LOG/site}${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, lightning, lightning_llm" || { echo "torch, lightning or the project does not import" >&2; exit 1; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
if [ "$QUICK" = 1 ]; then
  SIZE=tiny; SEQ=64; BATCH=4; STEPS=6; WARMUP=2; ROUNDS=1; CURVE_STEPS=6; DEVICE=cpu; PRECISION=bf16-mixed
  PEAK=(--peak-flops 1e12)
else
  SIZE=1B; SEQ=2048; BATCH=4; STEPS=30; WARMUP=5; ROUNDS=2; CURVE_STEPS=200; DEVICE=cuda; PRECISION=bf16-mixed
  PEAK=()
fi
STEP_TIMEOUT=${STEP_TIMEOUT:-0}  # seconds a step may run (0: no limit; --short: 150 unless set)
if [ "$SHORT" = 1 ]; then STEPS=15; WARMUP=3; ROUNDS=1; CURVE_STEPS=50; [ "$STEP_TIMEOUT" = 0 ] && STEP_TIMEOUT=150; fi
LOG=${SUITE_LOGS:-$(mktemp -d)}  # every step's log (SUITE_LOGS: a folder to keep them in)
mkdir -p "$LOG"
MFU_TABLE="$LOG/mfu.md"; CURVE_TABLE="$LOG/curve.md"; STEPS_TABLE="$LOG/steps.md"
FAILED=(); SKIPPED=()
START=$SECONDS

# Computed here, not in report(): the GPU image's bash fails to parse these substitutions inside a function.
MACHINE="$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'),\
 torch $("$PY" -c 'import os, torch; print(torch.__version__ + ", " + str(os.cpu_count()))') CPU cores."
COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
PACKAGES="$("$PY" -c 'import importlib.metadata as m
for n in ("torch", "lightning", "transformers", "deepspeed", "torchao", "wandb", "jsonargparse"):
    try: print(n, m.version(n), end="; ")
    except m.PackageNotFoundError: print(n, "absent", end="; ")')"

report() {  # the markdown report of every step run so far (also when the suite is stopped early)
  {
    echo "# GPU suite: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT"
    echo
    echo "Device: $MACHINE"
    echo "Command: \`bash benchmarks/gpu_suite.sh $ARGS\`"
    echo
    echo "## Throughput and MFU ($SIZE, $PRECISION, batch $BATCH x $SEQ; MFU against the bf16 peak, also for fp8)"
    echo
    cat "$MFU_TABLE" 2>/dev/null || echo "(no MFU results)"
    echo
    echo "## Planned memory (compare with the peak memory column)"
    echo
    for ac in none selective; do echo "- AC $ac: $(grep -s '^planned' "$LOG/plan-$SIZE-ac_$ac.log" || echo 'failed or not run')"; done
    echo
    echo "## fp8 vs bf16 loss curves ($CURVE_STEPS steps)"
    echo
    cat "$CURVE_TABLE" 2>/dev/null || echo "(no loss-curve results)"
    echo
    echo "## Tests"
    echo
    for name in pytest-gpu pytest-fp16-scaler pytest-8-ranks; do
      echo "- $name: $(tail -n 1 "$LOG/$name.log" 2>/dev/null || echo skipped)"; done
    echo
    echo "## Steps and wall time ($((SECONDS - START)) s in all)"
    echo
    echo "| step | result | wall time |"
    echo "| --- | --- | --- |"
    cat "$STEPS_TABLE"
    echo
    echo "Packages: $PACKAGES"
    echo
    echo "Failed steps: ${FAILED[*]:-none}. Skipped: ${SKIPPED[*]:-none}. Logs: $LOG"
  } >"$REPORT"
}
STEP_PID=
interrupted() {  # TERM/INT: stop the running step, write what was measured so far
  [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null
  FAILED+=("interrupted"); report; echo "Report written to $REPORT (interrupted)"; exit 124
}
trap interrupted TERM INT

run() {  # run NAME CMD...: keep the log, time it, note a failure, go on
  local name=$1; shift
  local began=$SECONDS status=ok
  echo ">>> $name: $*"
  # Under timeout always (0: no limit), in the background, then `wait`: bash runs a trap only once a foreground
  # command ends; timeout passes the trap's TERM on and KILLs 10 s later (Lightning's SIGTERM handler keeps going).
  timeout -k 10 "$STEP_TIMEOUT" "$@" >"$LOG/$name.log" 2>&1 &
  STEP_PID=$!
  if wait "$STEP_PID"; then tail -n 4 "$LOG/$name.log"; else
    status="failed (exit $?)"; echo "FAILED, see $LOG/$name.log"; tail -n 20 "$LOG/$name.log"; FAILED+=("$name"); fi
  echo "| $name | $status | $((SECONDS - began)) s |" >>"$STEPS_TABLE"
}

skip() {  # skip NAME REASON: a step this image cannot run, said in the report
  echo ">>> $1: skipped ($2)"; SKIPPED+=("$1"); echo "| $1 | skipped: $2 | 0 s |" >>"$STEPS_TABLE"
}

# 1. MFU: four bf16 configurations, then fp8 with the same four (--quick: four that use every flag,
#    since inductor takes minutes per compile on CPU).
for fp8 in "" "--fp8"; do
  for ac in none selective; do
    for compile in "" "--compile"; do
      name="mfu-$SIZE-ac_$ac${compile:+-compile}${fp8:+-fp8}"
      case "$QUICK:$name" in 1:*-ac_none-compile*|1:*-ac_selective-fp8|1:*-ac_selective-compile-fp8) continue ;; esac
      case "$SHORT:$name" in 1:*-ac_selective-compile*|1:*-ac_none-fp8|1:*-ac_selective-fp8) continue ;; esac
      if [ -n "$fp8" ] && ! has torchao.float8; then skip "$name" "torchao is not installed"; continue; fi
      run "$name" "$PY" benchmarks/mfu.py --size "$SIZE" --device "$DEVICE" --precision "$PRECISION" --ac "$ac" \
        $compile $fp8 --batch "$BATCH" --seq-len "$SEQ" --steps "$STEPS" --warmup "$WARMUP" --rounds "$ROUNDS" \
        "${PEAK[@]}" --markdown "$MFU_TABLE"
    done
  done
done
# 2. What the planner predicts for those runs (activation checkpointing "selective" is planned at "none").
for ac in none selective; do
  run "plan-$SIZE-ac_$ac" "$PY" benchmarks/planned_memory.py --size "$SIZE" --precision "$PRECISION" --ac "$ac" \
    --batch "$BATCH" --seq-len "$SEQ"
done
# 3. fp8 vs bf16 loss curves.
if ! has torchao.float8; then skip fp8-loss-curve "torchao is not installed"; else
run "fp8-loss-curve" "$PY" benchmarks/fp8_loss_curve.py --size "$SIZE" --device "$DEVICE" --steps "$CURVE_STEPS" \
  --batch "$BATCH" --seq-len "$SEQ" --markdown "$CURVE_TABLE"
fi
# 4. and 5. Tests: gpu-marked, fp16 with a loss scaler, then the 8-rank layouts (the last two collected only in
#    --quick: gloo ranks are slow on few cores, and CI's main job runs the fp16 test).
run "pytest-gpu" "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider
if [ "$SHORT" = 1 ]; then skip "pytest-fp16-scaler" "--short: gloo on CPU cores, run by CI"
elif [ "$QUICK" = 1 ]; then  # CI's main job runs it on CPU; here only that it is found
run "pytest-fp16-scaler" "$PY" -m pytest tests/strategies/test_fp16_parity.py --collect-only -q -p no:cacheprovider
else
run "pytest-fp16-scaler" "$PY" -m pytest tests/strategies/test_fp16_parity.py -q -rs -p no:cacheprovider
fi
if [ "$SHORT" = 1 ]; then
  skip "pytest-8-ranks" "--short: gloo on CPU cores, run by CI"
elif [ "$QUICK" = 1 ]; then
  run "pytest-8-ranks" "$PY" -m pytest tests/strategies/test_3d_parity.py --collect-only -q -p no:cacheprovider
else
  run "pytest-8-ranks" "$PY" -m pytest tests/strategies/test_3d_parity.py -q -rs --durations=0 -p no:cacheprovider
fi

report
echo "Report written to $REPORT"
[ ${#FAILED[@]} -eq 0 ]
