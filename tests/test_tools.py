"""The measurement tools' own logic that runs without a GPU (tools/launch_overhead.py, tools/mma_rates.py,
tools/kernel_times.py, tools/bench_dbias_reductions.py, ...)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
if not (TOOLS / "launch_overhead.py").exists():  # pragma: no cover - an installed cuflash without tools/
    pytest.skip("tools/ is not part of this installation", allow_module_level=True)


def nvrtc_or_skip():
    """cuflash's NVRTC binding, or a skip where CuPy or libnvrtc is missing."""
    from cuflash import _compile

    try:
        nvrtc = _compile._nvrtc()
        nvrtc.getVersion()
    except Exception as e:  # CuPy or libnvrtc missing
        pytest.skip(f"NVRTC is not usable here: {type(e).__name__}: {e}")
    return nvrtc


def import_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(TOOLS))


def test_against_loads_another_checkout_beside_this_one():
    """`launch_overhead.py --against DIR` times two cuflash packages in one process: the other one must be a
    separate module tree (its own plan cache and kernel table) that compiles its own checkout's kernels."""
    code = f"""
import sys
sys.argv = ["launch_overhead.py", "--fake"]
sys.path.insert(0, {str(TOOLS)!r})
import cuflash, launch_overhead
other = launch_overhead.load_other_cuflash({str(ROOT)!r})
assert other.__name__ == "cuflash_against" and other is not cuflash
assert other.api is not cuflash.api and other._plan.plans is not cuflash._plan.plans
assert other._launch._kernels is not cuflash._launch._kernels
assert other._compile.cuda_dir() == cuflash._compile.cuda_dir(), other._compile.cuda_dir()
assert sys.modules["cuflash_against.api"] is other.api
print("ok")
"""
    # a fresh interpreter: the loaded package stays in sys.modules, which this test process should not keep
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("shape", ["f64 m8n8k4", "f64 m16n8k4", "f64 m16n8k8", "f64 m16n8k16", "tf32 m16n8k8"])
def test_mma_rates_kernels_compile(shape):
    """tools/mma_rates.py's two kernels (the rate loop and the layout check) compile for each shape on sm_90a, and
    the shapes that sm_80 lacks are marked so (NVRTC refuses them there): the tool cannot rot unnoticed."""
    nvrtc = nvrtc_or_skip()
    mma_rates = import_tool("mma_rates")

    def compiles(arch: str) -> bool:
        prog = nvrtc.createProgram(mma_rates.kernel_source(shape), "mma_rates.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}"])
            return True
        except nvrtc.NVRTCError:
            return False
        finally:
            nvrtc.destroyProgram(prog)

    assert compiles("sm_90a")
    assert compiles("sm_80") == (mma_rates.SHAPES[shape][-1] <= 80)


def test_kernel_times_parses_its_arguments():
    """tools/kernel_times.py (per-launch GPU times of one call) imports and describes its options without a GPU, and
    refuses float32 tile overrides on a 16-bit dtype before touching the GPU."""
    out = subprocess.run([sys.executable, str(TOOLS / "kernel_times.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--main" in out.stdout and "--dq" in out.stdout, out.stderr[-2000:]
    out = subprocess.run([sys.executable, str(TOOLS / "kernel_times.py"), "--dtype", "bf16", "--main", "16,2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--dtype fp32 or tf32" in out.stderr, out.stderr[-2000:]
    for bad, message in ((["--batch", "4", "--bias-batch", "3"], "a divisor of --batch 4"),
                         (["--no-dbias"], "--no-dbias needs a bias")):
        out = subprocess.run([sys.executable, str(TOOLS / "kernel_times.py"), *bad], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr[-2000:])


def test_bench_dbias_reductions_kernel_compiles():
    """tools/bench_dbias_reductions.py (dBias reduction layouts): its kernel compiles for sm_90a (every layout is one
    branch of it), and a sequence length off the 128-key blocks is refused before touching the GPU."""
    out = subprocess.run([sys.executable, str(TOOLS / "bench_dbias_reductions.py"), "--seqlen", "200"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "a multiple of 128" in out.stderr, out.stderr[-2000:]
    nvrtc = nvrtc_or_skip()
    prog = nvrtc.createProgram(import_tool("bench_dbias_reductions").SOURCE, "reduce_dbias.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "-std=c++17"])
    finally:
        nvrtc.destroyProgram(prog)


def test_bench_float32_mods_describes_its_cases():
    """tools/bench_float32_mods.py (float32 with masks and ALiBi: the TF32 kernels against the mma.sync ones and SDPA)
    imports and lists its cases without a GPU, and refuses an unknown case before touching the GPU."""
    out = subprocess.run([sys.executable, str(TOOLS / "bench_float32_mods.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "evoformer-d64-bias-kpm" in out.stdout and "--precision" in out.stdout, \
        out.stderr[-2000:]
    out = subprocess.run([sys.executable, str(TOOLS / "bench_float32_mods.py"), "--cases", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr, out.stderr[-2000:]


def test_bench_blockmask_takes_float32():
    """tools/bench_blockmask.py lists its options without a GPU (float32 through --dtype) and refuses an unknown dtype
    before touching the GPU."""
    out = subprocess.run([sys.executable, str(TOOLS / "bench_blockmask.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--dtype" in out.stdout and "tf32" in out.stdout, out.stderr[-2000:]
    out = subprocess.run([sys.executable, str(TOOLS / "bench_blockmask.py"), "--dtype", "fp16"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("kind,table", [("blocks", "FWD_SM90_WS_TILES_BLOCKS"), ("kpm", "FWD_SM90_WS_TILES_MASK"),
                                        ("mask", "FWD_SM90_WS_TILES_MASK"), ("bias", "FWD_SM90_WS_TILES_BIAS"),
                                        ("bias-kpm", "FWD_SM90_WS_TILES_BIAS_MASK")])
def test_tune_tiles_mods_kinds_tune_the_table_their_calls_take(kind, table):
    """`tune_tiles.py --mods KIND` swaps entries of config.fwd_sm90_ws_table(d, causal, MODS_KINDS[KIND], n): the
    table the forward's config comes from with those modifiers (a bias beside a mask at head dim 64 takes the
    bias-and-mask tiles up to 512 keys, the modifier tiles above, as the library picks)."""
    from cuflash import config

    tune_tiles = import_tool("tune_tiles")
    mods = tune_tiles.MODS_KINDS[kind]
    for causal in (False, True):
        n = 512
        got = config.fwd_sm90_ws_table(64, causal, mods, seqlen_k=n)
        assert got is getattr(config, table), (kind, causal)
        cfg = config.fwd_sm90_ws_config(64, "bf16", causal, mods, seqlen_k=n)
        entry = got[64] + (False,) * (4 - len(got[64]))  # (block_n, stages, pingpong[, persistent[, block_m]])
        assert (cfg.block_n, cfg.stages, cfg.pingpong, cfg.persistent) == entry[:4], (kind, causal, cfg)
    if kind == "bias-kpm":
        assert config.fwd_sm90_ws_table(64, False, mods, seqlen_k=1024) is config.FWD_SM90_WS_TILES_MODS
        assert config.fwd_sm90_ws_table(128, False, mods, seqlen_k=256) is config.FWD_SM90_WS_TILES_MODS


def test_tune_tiles_rounds_time_every_other_round_in_reverse(monkeypatch, capsys):
    """`tune_tiles.py --rounds R`: the shipped tiles and each candidate (duplicates once) are timed R times, every other
    round in reverse order, each output compared with the shipped tiles' output, and the table entry restored."""
    import numpy as np

    tune_tiles = import_tool("tune_tiles")
    monkeypatch.setattr(tune_tiles, "cp", np)
    monkeypatch.setattr(tune_tiles, "resources", lambda cfg, arch: "regs=?")
    monkeypatch.setattr(tune_tiles, "ROUNDS", 3)
    monkeypatch.setattr(tune_tiles, "ONLY", None)
    shipped, b, c = (128, 2, True, True), (176, 2, False), (160, 2, False)
    table = {128: shipped}
    timed = []

    def run():
        timed.append(table[128])
        value = {shipped: 0.0, b: 0.5, c: 2.0}[table[128]]
        rate = {shipped: 100.0, b: 110.0 + len(timed), c: 90.0}[table[128]]
        return (1.0, rate), [np.full(4, value, dtype=np.float32)]

    tune_tiles.tune(table, [b, shipped, c], 128, "fwd ws", run, "sm_90a", lambda: None)
    assert timed == [shipped, b, c, c, b, shipped, shipped, b, c]
    assert table == {128: shipped}
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "tiles=" in line and "/ shipped" not in line]
    assert len(rows) == 9 and sum("(shipped)" in line for line in rows) == 3
    # the summary: each candidate over the shipped tiles of the same round (b timed 2nd, 5th, 8th: 112, 115, 118)
    assert [line for line in lines if "/ shipped" in line] == [
        f"  fwd ws tiles={b} / shipped: 1.12-1.18x (1.12 1.15 1.18)", f"  fwd ws tiles={c} / shipped: 0.90-0.90x "
        "(0.90 0.90 0.90)"]
    assert all(line.endswith("diff=5.0e-01") for line in rows if str(b) in line)
    assert all(line.endswith("diff=2.0e+00") for line in rows if str(c) in line)


def test_tune_tiles_fp8_tunes_the_table_its_calls_take():
    """`tune_tiles.py --dtype fp8` swaps entries of config.fwd_sm90_fp8_table(d, causal, seqlen_k=n), the table the
    FP8 forward's config comes from (the banded tiles for causal rows and windows, the short ones for non-causal rows
    of up to 4096 keys), and every candidate is a valid FwdSm90Fp8Config within the shared-memory limit."""
    from cuflash import config

    tune_tiles = import_tool("tune_tiles")
    assert config.fwd_sm90_fp8_table(64, True, seqlen_k=1024) is config.FWD_SM90_FP8_TILES_CAUSAL_SHORT
    assert config.fwd_sm90_fp8_table(64, True, seqlen_k=1025) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(64, False, window=True, seqlen_k=1024) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(64, False, window=True, seqlen_k=8192) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(128, True, seqlen_k=512) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(128, True, seqlen_k=1 << 20) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(256, True, seqlen_k=512) is config.FWD_SM90_FP8_TILES_BANDED
    assert config.fwd_sm90_fp8_table(128, False, seqlen_k=4096) is config.FWD_SM90_FP8_TILES_SHORT
    assert config.fwd_sm90_fp8_table(128, False, seqlen_k=4097) is config.FWD_SM90_FP8_TILES
    assert config.fwd_sm90_fp8_table(256, False, seqlen_k=1024) is config.FWD_SM90_FP8_TILES  # no persistent d256
    for d, cands in tune_tiles.FWD_SM90_FP8.items():
        assert d in config.FWD_SM90_FP8_TILES, d
        for causal in (False, True):
            table = config.fwd_sm90_fp8_table(d, causal, seqlen_k=4096)
            for cand in cands:
                cfg = config.FwdSm90Fp8Config(d, cand[0], cand[1], "bf16", causal, False, *cand[2:])
                assert cfg.smem_bytes <= 227 * 1024, (d, cand)
            shipped = config.fwd_sm90_fp8_config(d, "bf16", causal, seqlen_k=4096)
            assert (shipped.block_n, shipped.stages, shipped.pingpong, shipped.q_in_regs, shipped.late_pack,
                    shipped.consumers, shipped.persistent) == table[d] + (False,) * (7 - len(table[d]))
    out = subprocess.run([sys.executable, str(TOOLS / "tune_tiles.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "fp8" in out.stdout, out.stderr[-2000:]


def test_ab_trees_alternates_the_order_and_checks_its_arguments(tmp_path):
    """tools/ab_trees.py (this checkout against another, one process): each round times both checkouts, the other one
    first every other round; the speedup is the other's median time over this one's; a DIR without a cuflash package,
    no rounds, a negative --sustain or a length beyond the FA shapes' 16k tokens are refused before any GPU work (the
    tool imports CuPy only to run)."""
    ab = import_tool("ab_trees")
    seen = []
    times = ab.time_rounds({"this": "a", "other": "b"}, 3, lambda call: seen.append(call) or len(seen))
    assert seen == ["a", "b", "b", "a", "a", "b"]
    assert times == {"this": [1, 4, 5], "other": [2, 3, 6]}
    assert ab.speedup([1.0, 2.0, 3.0], [3.0, 4.0, 8.0]) == 2.0
    assert ab.parse_args(["--against", str(ROOT)]).passes == ["fwd", "bwd"]
    for bad, message in ((["--against", str(tmp_path)], "does not exist (DIR must be a checkout of cuflash)"),
                         (["--against", str(ROOT), "--rounds", "0"], "--rounds 0: at least 1"),
                         (["--against", str(ROOT), "--sustain", "-1"], "--sustain -1.0: seconds, 0 or more"),
                         (["--against", str(ROOT), "--n", "32768"], "--n 32768: a sequence length from 1 to 16384")):
        out = subprocess.run([sys.executable, str(TOOLS / "ab_trees.py"), *bad], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr[-2000:])


def test_ab_trees_compares_both_checkouts_on_the_same_inputs(capsys):
    """ab_trees.compare with stand-ins for CuPy, the bench helpers and two checkouts: both checkouts get the same input
    sets, the backward takes each checkout's own forward outputs, diff is the largest difference of the outputs, each
    round times both (the other first every other round), and a record per shape and pass carries the times."""
    import types

    import numpy as np

    ab = import_tool("ab_trees")
    seen_inputs, timed = [], []

    def tree(name, offset):
        def attention(q, k, v, causal):
            seen_inputs.append((name, id(q), id(k), id(v), causal))
            return q + k + offset

        def attention_forward(q, k, v, causal):
            return attention(q, k, v, causal), np.full(2, offset)

        def attention_backward(do, q, k, v, o, lse, causal):
            return do + lse[0], q, k * (1 + 4 * lse[0])  # lse: this checkout's forward's
        return types.SimpleNamespace(name=name, attention=attention, attention_forward=attention_forward,
                                     attention_backward=attention_backward)

    trees = {"this": tree("this", 0.0), "other": tree("other", 0.25)}
    calls_of = {}

    def median_ms(call, n_sets, events, reps, warmup):
        owner = next(name for name, c in calls_of.items() if c is call)
        timed.append(owner)
        call(0)
        return {"this": 1.0, "other": 2.0}[owner[0]]

    def time_rounds(calls, rounds, measure):  # remember which call is whose, then the real alternation
        calls_of.clear()
        calls_of.update({(name, len(timed)): c for name, c in calls.items()})
        return real_time_rounds(calls, rounds, measure)

    real_time_rounds = ab.time_rounds
    ab.time_rounds = time_rounds
    rng_values = iter(range(1000))
    from cuflash import bench

    fake_bench = types.SimpleNamespace(
        Shape=bench.Shape, sustain_s=0.0, CupyEvents=lambda: None, n_input_sets=lambda nbytes: 2, median_ms=median_ms,
        cuflash_kwargs=bench.cuflash_kwargs,
        random_array=lambda rng, dims, dtype: np.full((2, 3), float(next(rng_values)), dtype=np.float32))
    fake_cp = types.SimpleNamespace(random=types.SimpleNamespace(RandomState=lambda seed: seed), abs=np.abs,
                                    float64=np.float64,
                                    get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    args = ab.parse_args(["--against", str(ROOT), "--head-dims", "128", "--n", "1024", "--causal", "yes", "--rounds",
                          "3", "--sustain", "0.25"])
    try:
        records = ab.compare(args, trees, fake_cp, fake_bench, lambda x: np.asarray(x, dtype=np.float32))
    finally:
        ab.time_rounds = real_time_rounds
    assert fake_bench.sustain_s == 0.25
    # the forward outputs of both checkouts on both input sets, then the timed calls: always the same arrays
    by_tree = {name: [x[1:] for x in seen_inputs if x[0] == name] for name in trees}
    assert by_tree["this"] == by_tree["other"] and all(x[4] is True for x in seen_inputs)
    assert [r["pass"] for r in records] == ["fwd", "bwd"]
    fwd, bwd = records
    # o + 0.25; dq + lse (0.25), dk: k * 2 on the first set (k = 1.0) where each takes its own lse
    assert fwd["diff"] == 0.25 and bwd["diff"] == 1.0
    assert fwd["this_ms"] == [1.0] * 3 and fwd["other_ms"] == [2.0] * 3 and fwd["this_over_other"] == 2.0
    assert (fwd["batch"], fwd["heads"], fwd["seqlen"], fwd["head_dim"], fwd["causal"]) == (16, 16, 1024, 128, True)
    assert [owner[0] for owner in timed] == ["this", "other", "other", "this", "this", "other"] * 2
    out = capsys.readouterr().out
    assert "fwd D 128 causal yes N 1024: this 1.000 / 1.000 / 1.000 ms" in out and "this/other 2.000" in out
    # the benchmark's FLOP counts (bench.Shape): forward 4 B H N^2 D, backward 2.5x, half when causal; B 16, H 16
    fwd_tf, bwd_tf = (factor * 0.5 * 4 * 16 * 16 * 1024 ** 2 * 128 / 1e9 for factor in (1.0, 2.5))
    assert f"ms ({fwd_tf:.0f} TFLOP/s), other" in out and f"ms ({fwd_tf / 2:.0f}); this/other" in out
    assert f"ms ({bwd_tf:.0f} TFLOP/s), other" in out


def test_fp64_chain_order_emulation(capsys):
    """tools/fp64_chain_order.py: with S summed in the forward's order, dq stays within 1.2x plain float64's error
    whatever the lse's roundings; S as two chains added is several times further (the head-dim-128 backward before
    its key groups split S^T by queries)."""
    import numpy as np

    if np.finfo(np.longdouble).nmant < 60:  # the reference needs x87 or quad long doubles
        pytest.skip("np.longdouble is no wider than float64 here")
    assert import_tool("fp64_chain_order").main() == 0
    errors = {}
    for line in capsys.readouterr().out.splitlines():
        if "dq error" in line:
            name, value = line.split("dq error")
            errors[name.strip()] = float(value)
    plain = errors.pop("plain float64 attention")
    split = errors.pop("S as two chains of 64 added")
    assert len(errors) == 3 and all(e <= 1.2 * plain for e in errors.values()), errors
    assert split >= 5 * plain, (split, plain)


def test_ab_trees_compares_float64_outputs_in_float64():
    """ab_trees' diff of float64 outputs: two checkouts 1e-12 apart (below float32's rounding at 1.0) show it."""
    import types

    import numpy as np

    ab = import_tool("ab_trees")
    from cuflash import bench

    def tree(offset):
        return types.SimpleNamespace(attention=lambda q, k, v, causal: q + offset,
                                     attention_forward=lambda q, k, v, causal: (q + offset, np.zeros(2)),
                                     attention_backward=lambda do, q, k, v, o, lse, causal: (o, k, v))

    fake_bench = types.SimpleNamespace(
        Shape=bench.Shape, sustain_s=0.0, CupyEvents=lambda: None, n_input_sets=lambda nbytes: 1,
        median_ms=lambda call, n_sets, events, reps, warmup: call(0) is None or 1.0, cuflash_kwargs=bench.cuflash_kwargs,
        random_array=lambda rng, dims, dtype: np.ones((2, 3), dtype=np.float64))
    fake_cp = types.SimpleNamespace(random=types.SimpleNamespace(RandomState=lambda seed: seed), abs=np.abs,
                                    float64=np.float64,
                                    get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    args = ab.parse_args(["--against", str(ROOT), "--dtype", "fp64", "--head-dims", "64", "--n", "1024", "--causal",
                          "no", "--rounds", "1", "--sustain", "0"])
    fwd, bwd = ab.compare(args, {"this": tree(0.0), "other": tree(1e-12)}, fake_cp, fake_bench,
                          lambda x: np.asarray(x, dtype=np.float32))
    assert 0.9e-12 < fwd["diff"] < 1.1e-12 and 0.9e-12 < bwd["diff"] < 1.1e-12, (fwd["diff"], bwd["diff"])
