"""The benchmark's float32 / float64 rows (--dtype fp32 tf32 fp64) without a GPU: their arguments, the cuflash
precision of each, the anchors' dtypes, the SDPA refusal reasons, the FP32 / TF32 error rule of the arithmetic
checks (TF32 emulated in NumPy), the run loop with stand-in methods (tf32 rows sharing the fp32 anchors, refused
backends, out-of-memory rows, --time-limit), the ceiling block, the wide table and the JSON. The timed calls, the
cuBLAS ceilings and the torch probes themselves need a GPU."""
from __future__ import annotations

import json
import sys
import types
import warnings

import numpy as np
import pytest

from cuflash import bench


def parse(*argv):
    return bench.resolve_defaults(bench.build_parser().parse_args(list(argv)))


# --- arguments --------------------------------------------------------------------------------------------------

def test_wide_dtypes_parse_and_the_default_is_unchanged():
    args = parse("--dtype", "fp32", "tf32", "fp64", "--backward")
    assert args.dtype == ["fp32", "tf32", "fp64"] and args.backward
    assert (args.ceilings, args.ceiling_size, args.time_limit) == (True, 8192, None)
    args = parse("--dtype", "fp64", "--no-ceilings", "--ceiling-size", "4096", "--time-limit", "240")
    assert (args.ceilings, args.ceiling_size, args.time_limit) == (False, 4096, 240.0)
    default = parse()
    assert default.dtype == ["bf16", "fp16"] and default.seqlen == list(bench.DEFAULT_SEQLENS)
    assert bench.sweep_methods(default, torch=object()) == ["cuflash", "plain", "sdpa-flash", "sdpa-cudnn",
                                                            "sdpa-efficient"]  # no sdpa-math by default


@pytest.mark.parametrize("argv", [["--time-limit", "0"], ["--time-limit", "soon"], ["--dtype", "fp8"],
                                  ["--ceiling-size", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(argv)


@pytest.mark.parametrize("mode", ["--decode", "--varlen"])
def test_wide_dtypes_are_the_default_mode_only(mode, capsys):
    with pytest.raises(SystemExit):
        bench.main([mode, "--dtype", "bf16", "fp32"])
    assert "--dtype fp32: the default mode and --bias only" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["--decode", "--varlen"])
def test_window_is_refused_where_it_is_not_used(mode, capsys):
    with pytest.raises(SystemExit):
        bench.main([mode, "--window", "128", "0"])
    assert "--window 128 0: the default mode and --fp8 take a sliding window" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["tf32", "fp64"])
def test_bias_takes_fp32_but_no_other_wide_dtype(dtype, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--bias", "--dtype", "fp32", dtype])
    assert f"--bias --dtype {dtype}: --bias takes bf16, fp16 and fp32" in capsys.readouterr().err


def test_wide_dtypes_without_a_gpu_say_so(monkeypatch, capsys):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy, "is_available", lambda: False)
    assert bench.main(["--dtype", "fp32"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err


def test_help_describes_the_wide_dtypes(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for text in ("fp32", "tf32", "fp64", "3xTF32", "--ceilings", "--ceiling-size", "--time-limit", "sdpa-math",
                 "CUBLAS_COMPUTE_32F_FAST_TF32", "float32_matmul_precision"):
        assert text in out


# --- what each dtype runs -----------------------------------------------------------------------------------------

def test_precision_and_anchor_dtype_of_each_dtype():
    assert bench.cuflash_kwargs("fp32") == {"precision": "fp32"}
    assert bench.cuflash_kwargs("tf32") == {"precision": "tf32"}
    assert bench.cuflash_kwargs("fp64") == bench.cuflash_kwargs("bf16") == bench.cuflash_kwargs("fp16") == {}
    assert [bench.plain_compute_dtype(d) for d in ("fp16", "fp32", "tf32", "fp64")] == ["fp16", "fp32", "fp32", "fp64"]
    assert [bench.anchor_dtype(d) for d in bench.DTYPES] == ["bf16", "fp16", "fp32", "fp32", "fp64"]
    assert (bench.TORCH_DTYPE["tf32"], bench.TORCH_DTYPE["fp64"]) == ("float32", "float64")
    assert [bench.ITEMSIZE[d] for d in bench.DTYPES] == [2, 2, 4, 4, 8]


def test_flops_do_not_depend_on_the_dtype():
    flops = {d: bench.Shape(d, 128, True, 2048).flops("bwd") for d in bench.DTYPES}
    assert set(flops.values()) == {2.5 * 0.5 * 4 * 8 * 16 * 2048 * 2048 * 128}


@pytest.mark.parametrize("given,ordered", [
    (["bf16", "fp16"], ["bf16", "fp16"]), (["tf32", "fp64", "fp32"], ["fp64", "fp32", "tf32"]),
    (["tf32", "fp64"], ["tf32", "fp64"]), (["fp32", "bf16", "tf32"], ["fp32", "tf32", "bf16"])])
def test_tf32_runs_after_fp32(given, ordered):
    assert bench.ordered_dtypes(given) == ordered


def test_methods_of_each_dtype():
    torch = object()
    args = parse("--dtype", "bf16", "fp32")
    methods = bench.sweep_methods(args, torch)
    assert methods == ["cuflash", "plain", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"]
    assert "sdpa-math" not in bench.methods_for("bf16", methods, args)
    assert bench.methods_for("fp32", methods, args) == methods
    args = parse("--methods", "cuflash", "sdpa-math")  # bf16 / fp16 with the math backend asked for
    assert bench.methods_for("bf16", bench.sweep_methods(args, torch), args) == ["cuflash", "sdpa-math"]
    assert bench.sweep_methods(parse("--dtype", "fp64"), torch=None) == ["cuflash", "plain"]
    assert bench.sweep_methods(parse("--dtype", "fp64", "--no-compare"), torch=None) == ["cuflash"]


def test_ceilings_of_the_dtypes_asked_for():
    assert bench.ceilings_for(["fp32"]) == bench.ceilings_for(["tf32"]) == ["sgemm", "tf32-gemm"]
    assert bench.ceilings_for(["fp64"]) == ["dgemm"]
    assert bench.ceilings_for(["fp64", "tf32"]) == ["sgemm", "tf32-gemm", "dgemm"]
    assert bench.ceilings_for(["bf16"]) == []
    assert bench.CEILINGS["sgemm"][2] == "CUBLAS_COMPUTE_32F" and bench.CEILINGS["tf32-gemm"][2] == \
        "CUBLAS_COMPUTE_32F_FAST_TF32" and bench.CEILINGS["dgemm"][1:3] == ("float64", "CUBLAS_COMPUTE_64F")


# --- the arithmetic checks' rule -------------------------------------------------------------------------------

def tf32_round(x):
    """float32 rounded to TF32 (10 explicit mantissa bits, round to nearest even), as the tensor cores read it."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + (np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    return r.view(np.float32)


def test_the_error_rule_tells_fp32_from_tf32_products():
    rng = np.random.default_rng(0)
    k = bench.ARITH_CHECK_K
    a, b = rng.standard_normal((256, k)).astype(np.float32), rng.standard_normal((k, 256)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    fp32 = bench.rel_error(a @ b, ref)
    tf32 = bench.rel_error(tf32_round(a).astype(np.float64) @ tf32_round(b).astype(np.float64), ref)
    assert fp32 < bench.FP32_MAX_REL_ERROR / 10 and tf32 > bench.FP32_MAX_REL_ERROR * 10, (fp32, tf32)
    assert (bench.arithmetic_label(fp32), bench.arithmetic_label(tf32)) == ("FP32", "TF32-like")
    assert bench.arithmetic_label(1e-16, "float64") == "FP64" and bench.arithmetic_label(1e-7, "float64") == "not FP64"
    assert bench.arithmetic_label(None) == "?"


def test_matmul_check_line_and_its_warning(capsys):
    bench.print_matmul_checks({"plain": 1.2e-7, "sdpa-math": 4.0e-4})
    out = capsys.readouterr().out
    assert "plain (cupy.matmul, batched) 1.2e-07 FP32" in out
    assert "sdpa-math (torch.matmul at precision 'highest') 4.0e-04 TF32-like" in out
    assert "warning: sdpa-math multiplied float32 matrices with TF32-level error" in out
    bench.print_matmul_checks({})
    assert capsys.readouterr().out == ""


def test_cupy_tf32_setting_is_reported(monkeypatch):
    fake = types.ModuleType("cupy._core._routines_linalg")
    calls = []
    fake.COMPUTE_TYPE_DEFAULT = 1
    fake.set_compute_type = lambda dtype, t: calls.append((np.dtype(dtype), t))
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", fake)
    monkeypatch.setitem(sys.modules, "cupy._core", types.SimpleNamespace(_routines_linalg=fake))
    monkeypatch.delenv("CUPY_TF32", raising=False)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    assert bench.cupy_float32_without_tf32() == "" and calls == [(np.dtype(np.float32), 1)]
    monkeypatch.setenv("CUPY_TF32", "1")
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    note = bench.cupy_float32_without_tf32()
    assert "CUPY_TF32 is set" in note and "reset to its default (no TF32)" in note and "NVIDIA_TF32_OVERRIDE=0" in note


# --- SDPA's refusals ------------------------------------------------------------------------------------------

def test_unsupported_reason_names_the_dtype_warning_and_the_error():
    def refuse():  # as torch 2.11 refuses float32 in the flash backend
        warnings.warn("Flash attention requires q,k,v to have the same last dimension and to be on a CUDA device.")
        warnings.warn("Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, "
                      "Key dtype: float, and Value dtype: float instead. (Triggered internally at /pytorch/aten/src/"
                      "ATen/native/transformers/sdp_utils_cpp.h:91.)")
        raise RuntimeError("No available kernel. Aborting execution.")

    assert bench.unsupported_reason(refuse) == ("Expected query, key and value to all be of dtype: {Half, BFloat16}. "
                                                "Got Query dtype: float, Key dtype: float, and Value dtype: float "
                                                "instead.")

    def refuse_quietly():
        raise RuntimeError("No available kernel. Aborting execution.")

    assert bench.unsupported_reason(refuse_quietly) == "RuntimeError: No available kernel. Aborting execution."
    assert bench.unsupported_reason(lambda: None) == ""
    assert bench.unsupported_reason(lambda: (_ for _ in ()).throw(ValueError("bad"))) == "ValueError: bad"

    def oom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert bench.unsupported_reason(oom) == ""  # not a refusal: the measurement reports it


# --- the sweep with stand-in methods ----------------------------------------------------------------------------

TFLOPS = {("cuflash", "fp32"): 90.0, ("cuflash", "tf32"): 200.0, ("cuflash", "fp64"): 40.0, ("plain", "fp32"): 30.0,
          ("plain", "fp64"): 20.0, ("sdpa-efficient", "fp32"): 45.0, ("sdpa-math", "fp32"): 25.0,
          ("sdpa-math", "fp64"): 18.0}


def fake_bench(method, calls):
    def run(shape, args, out, torch=None):
        calls.append((method, shape.dtype, shape.head_dim, shape.seqlen))
        if method == "plain" and shape.dtype == "fp64" and shape.seqlen == 16384:
            raise MemoryError("cudaErrorMemoryAllocation: out of memory allocating 68719476736 bytes")
        for p in bench.PASSES if args.backward else ("fwd",):
            tf = TFLOPS[method, bench.anchor_dtype(shape.dtype) if method != "cuflash" else shape.dtype]
            out.append(shape.record(method, p, ms=shape.flops(p) / tf / 1e9, tflops=tf, peak_mem_bytes=5 << 20))
    return run


def fake_probe(torch, method, dtype, head_dim, backward):
    if method in ("sdpa-flash", "sdpa-cudnn"):
        return f"{method[5:]} attention takes fp16 and bf16 only"
    if method == "sdpa-efficient" and dtype == "fp64":
        return "Expected query, key and value to all be of dtype: {Half, BFloat16, Float}; got Double"
    return ""


@pytest.fixture
def stand_ins(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "free_memory", lambda torch=None: None)
    monkeypatch.setattr(bench, "SWEEP_BENCH", {m: fake_bench(m, calls) for m in bench.METHODS})
    monkeypatch.setattr(bench, "probe_sdpa", fake_probe)
    return calls


CEILINGS = [bench.Ceiling("sgemm", "FP32 SGEMM, CUDA cores", "CUBLAS_COMPUTE_32F", 8192, 22.0, 50.0, 1.1e-7, "FP32"),
            bench.Ceiling("tf32-gemm", "TF32 tensor-core GEMM", "CUBLAS_COMPUTE_32F_FAST_TF32", 8192, 2.75, 400.0,
                          4.9e-4, "TF32-like"),
            bench.Ceiling("dgemm", "FP64 DGEMM", "CUBLAS_COMPUTE_64F", 8192, None, None, note="skipped: out of memory")]


def test_sweep_shares_the_fp32_anchors_with_tf32_and_reports_refusals(stand_ins, capsys):
    args = parse("--dtype", "tf32", "fp64", "fp32", "--backward", "--head-dim", "64", "--seqlen", "1024", "16384",
                 "--causal", "no")
    methods = bench.sweep_methods(args, torch=object())
    records = bench.run_sweep(args, methods, object(), backward=True)
    out = capsys.readouterr().out
    # fp32 before tf32; the tf32 rows run cuflash only; flash and cuDNN never run (refused by the probe)
    assert [c for c in stand_ins if c[1] == "tf32"] == [("cuflash", "tf32", 64, 1024), ("cuflash", "tf32", 64, 16384)]
    assert {c[0] for c in stand_ins} == {"cuflash", "plain", "sdpa-efficient", "sdpa-math"}
    assert [c[1] for c in stand_ins if c[0] == "cuflash"] == ["fp64", "fp64", "fp32", "fp32", "tf32", "tf32"]
    tf32_plain = [r for r in records if (r.method, r.dtype) == ("plain", "tf32")]
    assert len(tf32_plain) == 6 and all(r.compute_dtype == "fp32" and r.note == bench.TF32_SHARED_NOTE and
                                        r.tflops == 30.0 for r in tf32_plain)
    assert out.count("note: sdpa-flash does not run float32 (fp32 rows)") == 1
    assert out.count("does not run float64 (fp64 rows)") == 3  # flash, cuDNN, efficient: once each
    assert "note: sdpa-flash does not run float32 (tf32 rows)" not in out  # tf32 takes the fp32 rows
    refused = [r for r in records if r.note.startswith("skipped: unsupported")]
    assert {(r.method, r.dtype) for r in refused} == {(m, d) for m in ("sdpa-flash", "sdpa-cudnn")
                                                      for d in ("fp32", "tf32", "fp64")} | {("sdpa-efficient", "fp64")}
    oom = [r for r in records if r.note == "skipped: out of memory"]
    assert [(r.method, r.dtype, r.seqlen, r.passname) for r in oom] == [("plain", "fp64", 16384, p)
                                                                       for p in bench.PASSES]
    assert "fp32 D=64 full N=1024 (B=16, H=32) fwd: cuflash 90, plain 30, sdpa-efficient 45, sdpa-math 25 TFLOP/s" \
        in out
    assert "tf32 D=64 full N=1024 (B=16, H=32) bwd: cuflash 200, plain 30, sdpa-efficient 45, sdpa-math 25 TFLOP/s" \
        in out

    bench.print_wide_table(records, methods, CEILINGS)
    out = capsys.readouterr().out
    assert "fwd, float32 / float64 inputs" in out and "fwd+bwd, float32 / float64 inputs" in out
    head = next(line for line in out.splitlines() if line.startswith("dtype"))
    assert "flash" not in head.split() and "cudnn" not in head  # no column for the backends that never ran
    assert head.startswith("dtype   D causal      N | cuflash   plain   effic    math |")
    assert "| cf/best  %gemm |" in head
    rows = [line for line in out.splitlines() if line[:5] in ("fp32 ", "tf32 ", "fp64 ")]
    fp32 = next(line for line in rows if line.startswith("fp32   64 no       1024"))
    assert "|    90.0    30.0    45.0    25.0 |" in fp32
    assert "|    2.00    180 |" in fp32  # the efficient backend's time / cuflash's; 90 / 50 (SGEMM)
    tf32 = next(line for line in rows if line.startswith("tf32   64 no       1024"))
    assert "|    4.44     50 |" in tf32  # 200 / 45; 200 / 400 (TF32 GEMM)
    fp64 = next(line for line in rows if line.startswith("fp64   64 no      16384"))
    assert "|    40.0       -       -    18.0 |" in fp64  # plain out of memory, no efficient backend for float64
    assert "|    2.22      - |" in fp64  # no DGEMM ceiling measured: no %gemm
    assert "3xTF32 on sm_80+" in out and "no anchor is a one-pass TF32 computation" in out
    assert ("skipped: plain fp64 fwd/bwd/fwd+bwd, 1 shape (D=64 full N=16384): out of memory") in out
    assert ("skipped: sdpa-flash fp32 fwd/bwd/fwd+bwd, 2 shapes (every shape): unsupported: flash attention takes "
            "fp16 and bf16 only") in out
    assert "skipped: sdpa-efficient fp64 fwd/bwd/fwd+bwd, 2 shapes (every shape)" in out
    lines = bench.skipped_summary([bench.Shape("fp64", 64, False, n).record("plain", "bwd", note="skipped: out of "
                                                                                "memory") for n in range(1, 9)]
                                  + [bench.Shape("fp64", 64, False, 9).record("plain", "fwd", ms=1.0)])
    assert lines == ["skipped: plain fp64 bwd, 8 shapes (D=64 full N=1, D=64 full N=2, D=64 full N=3, D=64 full N=4, "
                     "D=64 full N=5, D=64 full N=6 and 2 more): out of memory"]
    oom = [bench.Shape("fp64", 64, False, 4096).record("plain", p, note="skipped: out of memory")
           for p in ("bwd", "fwd+bwd")] + [bench.Shape("fp64", 64, False, 8192).record("plain", p, note="skipped: out "
                                                                                         "of memory") for p in bench.PASSES]
    assert bench.skipped_summary(oom) == [  # each shape with the passes it lost
        "skipped: plain fp64 bwd/fwd+bwd, 1 shape (D=64 full N=4096): out of memory",
        "skipped: plain fp64 fwd/bwd/fwd+bwd, 1 shape (D=64 full N=8192): out of memory"]


def test_tf32_alone_measures_its_float32_anchors(stand_ins, capsys):
    args = parse("--dtype", "tf32", "--head-dim", "128", "--seqlen", "2048", "--causal", "yes")
    bench.run_sweep(args, bench.sweep_methods(args, torch=object()), object(), backward=False)
    assert sorted(stand_ins) == sorted([(m, "tf32", 128, 2048) for m in ("cuflash", "plain", "sdpa-efficient",
                                                                          "sdpa-math")])
    assert "tf32 D=128 causal N=2048 (B=8, H=16) fwd: cuflash 200, plain 30" in capsys.readouterr().out


def test_time_limit_reports_the_shapes_not_run(stand_ins, capsys):
    args = parse("--dtype", "fp32", "fp64", "--head-dim", "64", "--seqlen", "1024", "--causal", "no",
                 "--time-limit", "5", "--backward")
    records = bench.run_sweep(args, ["cuflash", "plain"], None, backward=True, t_start=bench.time.perf_counter() - 10)
    assert stand_ins == []
    assert len(records) == 2 * 2 * 3 and all(r.note == "skipped: --time-limit 5 s reached" for r in records)
    assert "note: --time-limit 5 s reached: 2 shapes not run" in capsys.readouterr().out


def test_the_16_bit_table_keeps_its_columns(stand_ins, monkeypatch, capsys):
    args = parse("--dtype", "fp16", "--head-dim", "64", "--seqlen", "1024", "--causal", "no")
    methods = bench.sweep_methods(args, torch=object())
    monkeypatch.setitem(TFLOPS, ("cuflash", "fp16"), 300.0)
    for m in ("plain", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
        monkeypatch.setitem(TFLOPS, (m, "fp16"), 100.0)
    records = bench.run_sweep(args, methods, object(), backward=False)
    assert {c[0] for c in stand_ins} == {"cuflash", "plain", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"}
    bench.print_table(records, bench.methods_for("fp16", methods, args))
    bench.print_wide_table([], methods, CEILINGS)  # no wide rows: nothing
    out = capsys.readouterr().out
    assert "| cf/flash |" in out and "math" not in out and "float32 / float64" not in out


# --- the ceiling block and the JSON ---------------------------------------------------------------------------

def test_ceiling_block(capsys):
    bench.print_ceilings(CEILINGS)
    out = capsys.readouterr().out
    assert "cuBLAS GEMM ceilings, M = N = K = 8192" in out
    sgemm = next(line for line in out.splitlines() if line.startswith("  sgemm"))
    assert "FP32 SGEMM, CUDA cores (CUBLAS_COMPUTE_32F)" in sgemm and sgemm.rstrip().endswith(
        "50.0 TFLOP/s    22.00 ms   rel. error 1.1e-07 (FP32)")
    assert "   400.0 TFLOP/s     2.75 ms   rel. error 4.9e-04 (TF32-like)" in out
    assert "TF32 GEMM / 3: the tensor-core ceiling of 3xTF32" in out and "  133.3 TFLOP/s" in out
    assert "  dgemm     FP64 DGEMM (CUBLAS_COMPUTE_64F): skipped: out of memory" in out
    bench.print_ceilings([])
    assert capsys.readouterr().out == ""


def test_json_of_a_wide_run(stand_ins, monkeypatch, tmp_path, capsys):
    pytest.importorskip("cupy")
    monkeypatch.setattr(bench, "device_line", lambda cp, torch, cuflash: ("Fake GPU", types.SimpleNamespace(
        compute_capability="90")))
    monkeypatch.setattr(bench, "cupy_float32_without_tf32", lambda: "")
    monkeypatch.setattr(bench, "float32_matmul_checks", lambda torch=None: {"plain": 1e-7, "sdpa-math": 1e-7})
    monkeypatch.setattr(bench, "measure_ceiling", lambda name, size, args: next(
        bench.Ceiling(**{**bench.asdict(c), "size": size}) for c in CEILINGS if c.name == name))
    path = tmp_path / "wide.json"
    args = parse("--dtype", "fp32", "tf32", "--head-dim", "64", "--seqlen", "1024", "--causal", "no",
                 "--ceiling-size", "4096", "--json", str(path))
    fake_torch = types.SimpleNamespace(__version__="0")
    fake_cuflash = types.SimpleNamespace(__version__="0", attention_backward=None)
    assert bench.main_sweep(args, fake_cuflash, fake_torch) == 0
    out = capsys.readouterr().out
    assert out.index("float32 matmul check") < out.index("cuBLAS GEMM ceilings") < out.index("fp32 D=64 full")
    assert out.count("cuBLAS GEMM ceilings, M = N = K = 4096") == 2  # before the sweep and before the wide table
    data = json.loads(path.read_text())
    assert [c["name"] for c in data["ceilings"]] == ["sgemm", "tf32-gemm"] and data["ceilings"][0]["size"] == 4096
    assert data["float32_matmul_checks"] == {"plain": 1e-7, "sdpa-math": 1e-7}
    got = {(r["method"], r["dtype"]) for r in data["records"] if r["ms"]}
    assert got == {(m, d) for m in ("cuflash", "plain", "sdpa-efficient", "sdpa-math") for d in ("fp32", "tf32")}
    assert all(r["note"].startswith("skipped: unsupported") for r in data["records"]
               if r["method"] in ("sdpa-flash", "sdpa-cudnn"))


# --- the inputs and the plain anchor's math without a GPU -----------------------------------------------------------

class _RandomState(np.random.RandomState):
    def standard_normal(self, size=None, dtype=np.float64):  # CuPy's takes a dtype
        return super().standard_normal(size).astype(dtype)


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.__dict__.update({k: v for k, v in np.__dict__.items() if not k.startswith("__")})
    fake.random = types.SimpleNamespace(RandomState=_RandomState)
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_inputs_of_each_dtype(numpy_as_cupy):
    shape = bench.Shape("fp64", 64, False, 512)
    shape.batch, shape.heads = 2, 3  # small arrays
    got = {d: bench.cupy_inputs(shape, d, "bhsd", 2, True, seed=3) for d in ("fp16", "fp32", "tf32", "fp64")}
    assert [got[d][0][0].dtype for d in got] == [np.float16, np.float32, np.float32, np.float64]
    assert all(len(s) == 2 and len(s[0]) == 4 and s[0][0].shape == (2, 3, 512, 64) for s in got.values())
    assert np.array_equal(got["fp32"][0][0], got["tf32"][0][0])
    assert np.array_equal(got["fp16"][1][2], got["fp32"][1][2].astype(np.float16))  # 16-bit draws as before


def test_plain_anchor_in_float64_keeps_float64_accuracy(numpy_as_cupy):
    rng = np.random.default_rng(1)
    b, h, s, d, scale = 1, 2, 6, 8, 0.35
    q, k, v, dout = (rng.standard_normal((b, h, s, d)) for _ in range(4))
    o, p = bench.plain_forward(q, k, v, True, scale, bench.causal_bias(s, np.float64))
    dq, dk, dv = bench.plain_backward(dout, q, k, v, o, p, scale)

    def loss(q_):
        o_, _ = bench.plain_forward(q_, k, v, True, scale, bench.causal_bias(s, np.float64))
        return (o_ * dout).sum()

    eps, numeric = 1e-6, np.empty_like(q)
    for idx in np.ndindex(*q.shape):
        plus, minus = q.copy(), q.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric[idx] = (loss(plus) - loss(minus)) / (2 * eps)
    np.testing.assert_allclose(dq, numeric, rtol=1e-7, atol=1e-9)  # a float32 rowsum would miss this by ~1e-7
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == np.float64
