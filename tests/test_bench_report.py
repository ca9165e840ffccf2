"""The benchmark's report (table, ratios, skipped rows, plot) from synthetic records: no GPU needed."""
from __future__ import annotations

from cuflash import bench


def synthetic_records():
    out = []
    for n in (512, 4096):
        shape = bench.Shape("bf16", 128, True, n)
        assert (shape.batch, shape.heads) == (16384 // n, 2048 // 128)
        for method, tflops in (("cuflash", 300.0), ("plain", 40.0), ("sdpa-flash", 250.0), ("sdpa-cudnn", 500.0)):
            ms = shape.flops("fwd") / tflops / 1e9
            out.append(shape.record(method, "fwd", ms=ms, tflops=tflops, peak_mem_bytes=3 << 20,
                                    compute_dtype="fp16" if method == "plain" else None))
        out.append(shape.record("sdpa-efficient", "fwd", note="skipped: out of memory"))
    return out


def test_flop_counts_follow_the_fa_convention():
    s = bench.Shape("fp16", 64, False, 1024)
    assert s.flops("fwd") == 4 * 16 * 32 * 1024 * 1024 * 64
    assert bench.Shape("fp16", 64, True, 1024).flops("fwd") == s.flops("fwd") / 2
    assert s.flops("bwd") == 2.5 * s.flops("fwd") and s.flops("fwd+bwd") == 3.5 * s.flops("fwd")


def test_table_has_ratios_memory_and_notes(capsys):
    bench.print_table(synthetic_records(), list(bench.METHODS))
    out = capsys.readouterr().out
    assert "fwd TFLOP/s" in out and "cf/flash" in out
    assert "    1.20 |" in out  # 300 / 250
    assert "computed in fp16" in out
    assert "skipped: sdpa-efficient bf16 D=128 causal=True N=512: out of memory" in out


def test_plot_is_written(tmp_path):
    path = tmp_path / "bench.png"
    bench.plot(synthetic_records(), str(path))
    assert path.stat().st_size > 1000
