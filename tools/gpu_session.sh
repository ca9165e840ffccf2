#!/usr/bin/env bash
# One device call, several stages: `tools/gpu_session.sh STAGE [STAGE ...]`, run from the repository root
# on the lent GPU machine (no package index there: cuflash is installed without dependencies, the image
# has CuPy, NumPy, Numba, ml_dtypes, pytest, pytest-xdist and torch). Logs go to $OUT (at most 8 files
# come back, so each stage writes one log and the summary collects the last lines of each).
#
#   env       GPU, driver, package versions; fills the kernel cache for sm_90a with every CPU at once
#   layouts   tools/check_wgmma_layouts.py (wgmma descriptors against the shared-memory layouts)
#   tests     python -m pytest -m gpu (every GPU test but the long sweep), 6 xdist workers: the default
#             kernels (wgmma on an H100)
#   tests_mma the same with CUFLASH_KERNELS=mma (the mma.sync kernels that sm_80..sm_89 run)
#   tune      tools/tune_tiles.py (candidate tile sizes, timed)
#   bench     python -m cuflash.bench --backward (bf16 + fp16, D 64/128/256, causal and not, N 512..16k)
#   sanitize  python -m cuflash.check sanitize (memcheck, racecheck, initcheck, synccheck), default kernels
#   sanitize_mma  the same with CUFLASH_KERNELS=mma
#   sweep     the 2000-configuration gpu_slow sweep
#   ncu       python -m cuflash.simulator.validate (the analyzer against hardware counters)
#   python:FILE   runs tools/FILE.py (for one-off measurements kept in the repository)
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUFLASH_CACHE_DIR=/tmp/cuflash-cache
PY=python3
summary="$OUT/summary.txt"

stage_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    $PY -c "import cupy, numpy, numba, ml_dtypes, cuflash; from cupy_backends.cuda.libs import nvrtc; \
print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__, 'nvrtc', nvrtc.getVersion())"
    $PY -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
    $PY - <<'EOF'
import time
from concurrent.futures import ThreadPoolExecutor
from cuflash import _compile, config
cfgs = config.all_fwd_configs("sm_90a") + config.all_bwd_configs()
t0 = time.perf_counter()
with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda c: _compile.compile_kernel(c.cpp_name(), "sm_90a"), cfgs))
print(f"kernel cache: {len(cfgs)} sm_90a kernels compiled in {time.perf_counter() - t0:.1f} s")
EOF
  } > "$OUT/env.txt" 2>&1
  tail -4 "$OUT/env.txt" >> "$summary"
}

stage_layouts() {
  timeout 120 $PY tools/check_wgmma_layouts.py > "$OUT/layouts.txt" 2>&1
  echo "layouts exit $?: $(tail -1 "$OUT/layouts.txt")" >> "$summary"
}

stage_tests() {
  timeout "${TESTS_TIMEOUT:-480}" $PY -m pytest -q -m gpu -n 6 -p no:cacheprovider -rfE --tb=line tests \
    > "$OUT/tests.txt" 2>&1
  echo "tests exit $?: $(tail -1 "$OUT/tests.txt")" >> "$summary"
}

stage_tests_mma() {
  CUFLASH_KERNELS=mma timeout "${TESTS_TIMEOUT:-480}" $PY -m pytest -q -m gpu -n 6 -p no:cacheprovider -rfE \
    --tb=line tests > "$OUT/tests_mma.txt" 2>&1
  echo "tests (CUFLASH_KERNELS=mma) exit $?: $(tail -1 "$OUT/tests_mma.txt")" >> "$summary"
}

stage_tune() {
  timeout "${TUNE_TIMEOUT:-240}" $PY tools/tune_tiles.py ${TUNE_ARGS:-} > "$OUT/tune.txt" 2>&1
  echo "tune exit $?" >> "$summary"
}

stage_bench() {
  # BENCH_ARGS narrows it (the whole grid takes longer than one call may run)
  timeout "${BENCH_TIMEOUT:-540}" $PY -m cuflash.bench --backward ${BENCH_ARGS:---head-dim 64 128 256} \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2>&1
  echo "bench exit $?" >> "$summary"
}

stage_sanitize() {
  timeout 560 $PY -m cuflash.check sanitize --out /tmp/sanitize > "$OUT/sanitize.txt" 2>&1
  echo "sanitize exit $?: $(tail -3 "$OUT/sanitize.txt" | tr '\n' ' ')" >> "$summary"
}

stage_sanitize_mma() {
  CUFLASH_KERNELS=mma timeout 560 $PY -m cuflash.check sanitize --out /tmp/sanitize_mma > "$OUT/sanitize_mma.txt" 2>&1
  echo "sanitize (CUFLASH_KERNELS=mma) exit $?: $(tail -3 "$OUT/sanitize_mma.txt" | tr '\n' ' ')" >> "$summary"
}

stage_sweep() {
  CUFLASH_SWEEP_REPORT="$OUT/sweep.json" timeout 580 $PY -m pytest -q -s -m gpu_slow -p no:cacheprovider \
    tests/test_gpu_sweep.py > "$OUT/sweep.txt" 2>&1
  echo "sweep exit $?: $(tail -1 "$OUT/sweep.txt")" >> "$summary"
}

stage_ncu() {
  timeout 560 $PY -m cuflash.simulator.validate --out "$OUT/IO_VALIDATION.md" --raw-dir /tmp/ncu_raw \
    --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --timeout 180 --budget-s 480 > "$OUT/ncu.txt" 2>&1
  echo "ncu exit $?" >> "$summary"
  tar czf "$OUT/ncu_raw.tgz" -C /tmp ncu_raw 2>/dev/null
}

for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    python:*) $PY "tools/${stage#python:}.py" > "$OUT/${stage#python:}.txt" 2>&1; echo "$stage exit $?" >> "$summary" ;;
    *) "stage_$stage" ;;
  esac
  echo "== $stage: $(( $(date +%s) - t0 )) s" >> "$summary"
done
cat "$summary"
