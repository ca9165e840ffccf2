#!/usr/bin/env bash
# Run GPU tests, sanitizers, benchmarks, the ncu validation and the tuners as stages of one call on a GPU machine.
#
# `tools/gpu_session.sh STAGE [STAGE ...]`, run from the repository root on a GPU machine. It needs no package
# index (cuflash is installed without dependencies) but an environment with CuPy, NumPy, Numba, ml_dtypes,
# pytest, pytest-xdist and torch. Each stage logs to $LOGS and appends the end of its log to
# $OUT/summary.txt; the logs are packed into $OUT/logs.tgz after every stage, so a call stopped at a time
# limit keeps the summary and the logs of the stages it finished.
#
#   env           GPU, driver, package versions; fills the kernel cache (every shipped sm_90a kernel)
#   layouts       tools/check_wgmma_layouts.py (wgmma descriptors against the shared-memory layouts)
#   tests         python -m pytest -m gpu (every GPU test but the long sweep), 8 xdist workers, 420 s
#                 (TESTS_TIMEOUT), default kernels (wgmma on an H100)
#   tests_mma     the same with CUFLASH_KERNELS=mma (the mma.sync kernels that sm_80..sm_89 run)
#   sanitize      python -m cuflash.check sanitize (memcheck, racecheck, initcheck, synccheck), default kernels;
#                 SANITIZE_ONLY: a regular expression of case names (its --only)
#   sanitize_mma  the same with CUFLASH_KERNELS=mma
#   sweep         the 2000-configuration gpu_slow sweep
#   bench         python -m cuflash.bench --backward $BENCH_ARGS (JSON and plot kept)
#   bench_decode  python -m cuflash.bench --decode; bench_varlen: --varlen; bench_bias: --bias $BIAS_ARGS
#   bench_fp8     python -m cuflash.bench --fp8 $FP8_ARGS (JSON kept); fp8_accuracy: tools/fp8_accuracy.py (JSON kept)
#   ncu           python -m cuflash.simulator.validate (the analyzer against hardware counters); NCU_ARGS: more of
#                 its arguments, e.g. "--kernels bwd_sm90_ws_kernel" (only those targets) or "--cases full"
#   overhead      tools/launch_overhead.py (host cost of a call)
#   tune          tools/tune_tiles.py $TUNE_ARGS
#   tune_decode   tools/tune_decode.py $TUNE_DECODE_ARGS (decode pipeline depth and split factor)
#   families      tools/bench_bwd_families.py $FAMILIES_ARGS (backward kernel families side by side)
#   ab            tools/ab_trees.py --against $AB_AGAINST $AB_ARGS (this tree against another checkout; JSON kept)
#   racecheck_ws  racecheck alone over the head-dim-64/128 16-bit cases (the Hopper ws backward), with its
#                 distinct hazard sites
#   ring_env      a light env for the ring stages: install, versions, NCCL, the GPUs' topology (no kernel cache fill)
#   ring          the one-GPU ring tests (tests/test_gpu_ring.py) and the multi-GPU ones (-m multigpu)
#   bench_ring    python -m cuflash.bench --ring $RING_ARGS (context-parallel scaling against one GPU; JSON kept);
#                 bench_ring2: a second one with $RING2_ARGS
#   (TESTS_PATHS narrows tests/tests_mma to some files, e.g. "tests/test_gpu_kvcache.py")
set -u
OUT="${OUT:-/tmp/out}"
LOGS=/tmp/cuflash-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 CUFLASH_CACHE_DIR=/tmp/cuflash-cache
PY=python3
summary="$OUT/summary.txt"
note() { echo "$*" >> "$summary"; }

stage_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    $PY -c "import cupy, numpy, numba, ml_dtypes, cuflash; from cupy_backends.cuda.libs import nvrtc; \
print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__, 'nvrtc', nvrtc.getVersion())"
    $PY -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
    # a -c script, not stdin: the compile's worker processes are spawned and re-import the main script
    $PY -c '
import time
from cuflash import check, config
cfgs = config.all_fwd_configs("sm_90a") + config.all_bwd_configs("sm_90a")
t0 = time.perf_counter()
# parallel processes (NVRTC holds the GIL: threads compile one kernel at a time); ~70 s for all on an H100 host
failed = {n: e for n, e in check.compile_configs(cfgs, "sm_90a").items() if e}
print(f"kernel cache: {len(cfgs)} sm_90a kernels compiled in {time.perf_counter() - t0:.1f} s, {len(failed)} failed")
for name, err in list(failed.items())[:5]:
    print(f"  {name}: {err}")
'
  } > "$LOGS/env.txt" 2>&1
  tail -4 "$LOGS/env.txt" >> "$summary"
}

run_logged() {  # name timeout command...: run, log, note exit code and last lines
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  note "$name exit $?: $(tail -${TAIL:-2} "$LOGS/$name.txt" | tr '\n' ' ')"
}

stage_layouts() { run_logged layouts 120 $PY tools/check_wgmma_layouts.py; }
stage_tests() {
  # the slowest tests listed at the end, and the stacks of any test still running after 120 s (a hang shows where)
  run_logged tests "${TESTS_TIMEOUT:-420}" $PY -m pytest -q -m gpu -n 8 -p no:cacheprovider -rfEs --tb=line \
    --durations=20 -o faulthandler_timeout=120 ${TESTS_PATHS:-tests}
}
stage_tests_mma() {
  CUFLASH_KERNELS=mma run_logged tests_mma "${TESTS_TIMEOUT:-420}" $PY -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    -rfEs --tb=line ${TESTS_PATHS:-tests}
}
stage_sanitize() {
  TAIL=8 run_logged sanitize "${SANITIZE_TIMEOUT:-400}" $PY -m cuflash.check sanitize --out /tmp/sanitize \
    --deadline "$(( ${SANITIZE_TIMEOUT:-400} - 30 ))" ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"}
}
stage_sanitize_mma() {
  CUFLASH_KERNELS=mma TAIL=8 run_logged sanitize_mma "${SANITIZE_TIMEOUT:-400}" $PY -m cuflash.check sanitize \
    --out /tmp/sanitize_mma --deadline "$(( ${SANITIZE_TIMEOUT:-400} - 30 ))"
}
stage_sweep() {
  CUFLASH_SWEEP_REPORT="$OUT/sweep.json" TAIL=3 run_logged sweep "${SWEEP_TIMEOUT:-500}" $PY -m pytest -q -s -m gpu_slow \
    -p no:cacheprovider tests/test_gpu_sweep.py
}
stage_bench() {
  run_logged "bench${BENCH_NAME:-}" "${BENCH_TIMEOUT:-540}" $PY -m cuflash.bench --backward ${BENCH_ARGS:-} \
    --json "$OUT/bench${BENCH_NAME:-}.json" --plot "$OUT/bench${BENCH_NAME:-}.png"
}
stage_bench2() {  # a second benchmark in the same call (e.g. every method at one sequence length)
  BENCH_NAME=2 BENCH_ARGS="${BENCH2_ARGS:-}" BENCH_TIMEOUT="${BENCH2_TIMEOUT:-240}" stage_bench
}
stage_reliability() {  # the sanitizers (both kernel families, one after the other) beside the sweep
  (stage_sanitize; stage_sanitize_mma) &
  stage_sweep
  wait
}
stage_bench_decode() { TAIL=30 run_logged bench_decode "${DECODE_TIMEOUT:-240}" $PY -m cuflash.bench --decode ${DECODE_ARGS:-}; }
stage_bench_bias() {
  TAIL=40 run_logged bench_bias "${BIAS_TIMEOUT:-400}" $PY -m cuflash.bench --bias ${BIAS_ARGS:-} --json "$OUT/bench_bias.json"
}
stage_bench_varlen() { TAIL=12 run_logged bench_varlen 180 $PY -m cuflash.bench --varlen; }
stage_bench_fp8() {
  TAIL=40 run_logged bench_fp8 "${FP8_TIMEOUT:-400}" $PY -m cuflash.bench --fp8 ${FP8_ARGS:-} --json "$OUT/bench_fp8.json"
}
stage_fp8_accuracy() { TAIL=24 run_logged fp8_accuracy 200 $PY tools/fp8_accuracy.py --json "$OUT/fp8_accuracy.json"; }
stage_ring_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m
    env | grep -E '^NCCL_|MULTICAST|NVLS' | sort
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    $PY -c "import cupy, cuflash; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.available, \
nccl.get_version() if nccl.available else '-', 'gpus', cupy.cuda.runtime.getDeviceCount())"
  } > "$LOGS/ring_env.txt" 2>&1
  tail -3 "$LOGS/ring_env.txt" >> "$summary"
}
stage_ring() {
  TAIL=4 run_logged ring_gpu "${RING_TESTS_TIMEOUT:-300}" $PY -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfEs \
    --tb=short tests/test_gpu_ring.py
  TAIL=4 run_logged ring_multigpu "${RING_TESTS_TIMEOUT:-300}" $PY -m pytest -q -m multigpu -p no:cacheprovider -rfEs \
    --tb=short tests/test_multigpu_ring.py
}
stage_bench_ring() {
  TAIL=12 run_logged "bench_ring${RING_NAME:-}" "${RING_BENCH_TIMEOUT:-420}" $PY -m cuflash.bench --ring ${RING_ARGS:-} \
    --json "$OUT/bench_ring${RING_NAME:-}.json"
}
stage_bench_ring2() {  # a second ring benchmark in the same call (e.g. not causal)
  RING_NAME=2 RING_ARGS="${RING2_ARGS:-}" RING_BENCH_TIMEOUT="${RING2_BENCH_TIMEOUT:-200}" stage_bench_ring
}
stage_ncu() {
  TAIL=3 run_logged ncu "${NCU_TIMEOUT:-500}" $PY -m cuflash.simulator.validate --out "$OUT/IO_VALIDATION.md" \
    --raw-dir /tmp/ncu_raw --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --timeout 120 \
    --budget-s "$(( ${NCU_TIMEOUT:-500} - 40 ))" ${NCU_ARGS:-}
  tar czf "$OUT/ncu_raw.tgz" -C /tmp ncu_raw 2>/dev/null
}
stage_overhead() { TAIL="${OVERHEAD_TAIL:-5}" run_logged overhead 120 $PY tools/launch_overhead.py ${OVERHEAD_ARGS:-}; }
stage_tune_decode() { TAIL=60 run_logged tune_decode "${TUNE_TIMEOUT:-240}" $PY tools/tune_decode.py ${TUNE_DECODE_ARGS:-}; }
stage_tune() { TAIL=60 run_logged tune "${TUNE_TIMEOUT:-240}" $PY tools/tune_tiles.py ${TUNE_ARGS:-}; }
stage_families() { TAIL=16 run_logged families 180 $PY tools/bench_bwd_families.py ${FAMILIES_ARGS:-}; }
stage_ab() {
  TAIL=30 run_logged ab "${AB_TIMEOUT:-400}" $PY tools/ab_trees.py --against "${AB_AGAINST:?the other checkout}" \
    ${AB_ARGS:-} --json "$OUT/ab.json"
}
stage_racecheck_ws() {
  TAIL=30 run_logged racecheck_ws 240 $PY -m cuflash.check sanitize --tools racecheck --only 'd(64|128)-(fp16|bf16)' \
    --out /tmp/racecheck_ws --deadline 200
}

for stage in "$@"; do
  t0=$(date +%s)
  "stage_$stage"
  note "== $stage: $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
done
cat "$summary"
