"""The benchmark's --decode and --varlen modes without a GPU: their defaults, the shapes they measure or
skip, the byte and FLOP counts, and their report tables from synthetic records. The default mode is unchanged."""
from __future__ import annotations

import argparse

import pytest

from cuflash import bench


def parse(*argv):
    return bench.resolve_defaults(bench.build_parser().parse_args(list(argv)))


def test_default_mode_keeps_its_defaults():
    args = parse()
    assert (args.dtype, args.head_dim, args.seqlen) == (["bf16", "fp16"], [64, 128], list(bench.DEFAULT_SEQLENS))
    assert not args.decode and not args.varlen
    assert parse("--dtype", "fp16", "--seqlen", "1024").dtype == ["fp16"]


def test_decode_defaults_are_bf16_d128_gqa_32_over_8():
    args = parse("--decode")
    assert (args.dtype, args.head_dim, args.decode_heads) == (["bf16"], [128], [(32, 8)])
    assert (args.decode_batch, args.decode_cache, args.decode_max_gb) == ([1, 8, 64], [1024, 8192, 32768, 131072], 20.0)
    assert parse("--decode", "--decode-heads", "32:32", "8:1").decode_heads == [(32, 32), (8, 1)]


def test_varlen_defaults():
    args = parse("--varlen")
    assert (args.dtype, args.head_dim, args.seqlen) == (["bf16"], [64, 128], [1024, 4096, 16384])


def test_decode_and_varlen_exclude_each_other():
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--decode", "--varlen"])


@pytest.mark.parametrize("text", ["32", "32:5", "0:0", "a:b", "8:16"])
def test_bad_head_pairs_are_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError, match="H_q"):
        bench.parse_heads(text)


def test_kv_bytes_and_the_20_gb_limit():
    assert bench.decode_kv_bytes(1, 1024, 8, 128) == 2 * 1024 * 8 * 128 * 2  # K and V, bf16, read once
    shapes = bench.decode_shapes([1, 64], [1024, 131072], [(32, 8)], 128, 20.0)
    skipped = [(b, n) for b, n, _, _, why in shapes if why]
    assert skipped == [(64, 131072)]  # 34.4 GB of K/V
    assert "34.4 GB > --decode-max-gb 20" in shapes[-1][4]


def synthetic_decode():
    rows = []
    for b, n in ((1, 1024), (8, 32768)):
        kv = bench.decode_kv_bytes(b, n, 8, 128)
        for method, gbps, note in (("cuflash", 2400.0, ""), ("cuflash-lens", 2000.0, ""), ("sdpa", 1600.0, "flash")):
            ms = kv / gbps / 1e6
            rows.append(bench.DecodeRecord(method, "bf16", b, n, 32, 8, 128, kv, ms, gbps, 100 * gbps / 3000, note))
    rows.append(bench.DecodeRecord("cuflash", "bf16", 64, 131072, 32, 8, 128, bench.decode_kv_bytes(64, 131072, 8, 128),
                                   note="skipped: K/V 34.4 GB > --decode-max-gb 20"))
    return rows


def test_decode_table_shows_bandwidth_ceiling_share_and_ratio(capsys):
    bench.print_decode_table(synthetic_decode(), 3000.0)
    out = capsys.readouterr().out
    assert "device-copy ceiling 3000 GB/s" in out
    assert "  2400    80 |" in out and "  1600    53 flash" in out  # GB/s and % of the copy ceiling
    assert "cf/sdpa +lens/sdpa" in out
    row = next(line for line in out.splitlines() if line.startswith("bf16") and "   1024 " in line)
    lens_us = bench.decode_kv_bytes(1, 1024, 8, 128) / 2000.0 / 1e6 * 1e3
    assert f"| {lens_us:8.1f} |" in row  # the length-array call's time
    assert row.endswith("   1.50       1.25")  # cuflash / sdpa, cuflash with lengths / sdpa
    assert "skipped: K/V 34.4 GB" in out


def test_decode_table_keeps_head_dims_apart(capsys):
    """`--decode --head-dim 64 128`: one row per head dim, each against the SDPA time of its own head dim."""
    rows = []
    for d, ours in ((64, 3000.0), (128, 1500.0)):
        kv = bench.decode_kv_bytes(8, 8192, 8, d)
        for method, gbps, note in (("cuflash", ours, ""), ("cuflash-lens", ours, ""), ("sdpa", 2000.0, "cudnn")):
            rows.append(bench.DecodeRecord(method, "bf16", 8, 8192, 32, 8, d, kv, kv / gbps / 1e6, gbps,
                                           100 * gbps / 3000, note))
    bench.print_decode_table(rows, 3000.0)
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bf16")]
    assert len(out) == 2
    assert " 32/8  64   8    8192 " in out[0] and out[0].endswith("   1.50       1.50")
    assert " 32/8 128   8    8192 " in out[1] and out[1].endswith("   0.75       0.75")


def test_varlen_lengths_hold_16k_tokens_within_the_bound():
    lengths = bench.varlen_lengths(4096, seed=4096)
    assert sum(lengths) == bench.TOKENS and all(1 <= n <= 4096 for n in lengths) and len(set(lengths)) > 1
    assert bench.varlen_useful_flops([3, 5], 2, 64, False) == 4 * 2 * 64 * (9 + 25)
    assert bench.varlen_useful_flops([3, 5], 2, 64, True) == 2 * 2 * 64 * (9 + 25)


def test_varlen_table(capsys):
    records = []
    for method, tf in (("cuflash-varlen", 300.0), ("cuflash-padded", 150.0)):
        for p in ("fwd", "bwd"):
            records.append(bench.Record(method, p, "bf16", 128, True, 4096, 7, 16, ms=1.0, tflops=tf))
    bench.print_varlen_table(records)
    out = capsys.readouterr().out
    assert "useful-token TFLOP/s" in out
    assert "bf16  128 yes      4096     7 |      300.0   150.0   2.00 |      300.0   150.0   2.00" in out
