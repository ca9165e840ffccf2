set -u
export OUT=${OUT:-/tmp/out}
mkdir -p $OUT
TESTS_TIMEOUT=330 bash tools/gpu_session.sh env tests
timeout 90 python3 tools/bench_bwd_families.py --families bwd_sm90_ws bwd_sm90 --head-dims 64 --n 1024 4096 16384 > $OUT/families.txt 2>&1
echo "families exit $?" >> $OUT/summary.txt
tail -20 $OUT/families.txt
grep -E "FAILED|Error" /tmp/cuflash-logs/tests.txt | head -30
