"""The benchmark's --bias mode without a GPU: its arguments, default shapes and memory cap, FLOP and byte counts,
the plain attention's bias and dbias (NumPy standing in for CuPy), the SDPA bias expansion, the run loop with
stand-in methods, its table and its JSON. The timed calls themselves need a GPU (and torch for sdpa-mem)."""
from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np
import pytest

from cuflash import bench


def parse(*argv):
    return bench.resolve_defaults(bench.build_parser().parse_args(list(argv)))


def shapes_of(*argv):
    args = parse("--bias", *argv)
    return bench.bias_shapes(args.bias_shapes, args.dtype, args.seqlen, args.head_dim, args.evoformer_shapes,
                             args.bias_max_gb, args.msa_mask)


# --- arguments and shapes ------------------------------------------------------------------------------------

def test_bias_defaults():
    args = parse("--bias")
    assert args.bias and not args.decode and not args.varlen
    assert (args.dtype, args.seqlen, args.head_dim) == (["bf16"], None, None)  # bias_shapes' own defaults
    assert (args.bias_shapes, args.evoformer_shapes, args.bias_max_gb) == (["evoformer", "llm"], None, 16.0)
    assert parse("--bias", "--dtype", "bf16", "fp16").dtype == ["bf16", "fp16"]
    assert parse().seqlen == list(bench.DEFAULT_SEQLENS)  # the default mode is unchanged


def test_bias_excludes_the_other_modes():
    for other in ("--decode", "--varlen"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["--bias", other])


def test_default_evoformer_shapes_cover_the_ranges():
    evo = [s for s in shapes_of() if s.family == "evoformer"]
    assert len(evo) == len(bench.EVOFORMER_SHAPES) == 8
    assert {s.seqlen for s in evo} == {256, 512, 768}
    assert {s.heads for s in evo} == {4, 8} and {s.head_dim for s in evo} == {32, 64}
    assert min(s.batch for s in evo) == 128 and max(s.batch for s in evo) == 1024
    assert all(s.bias_batch == 1 and s.rows == s.batch and s.dtype == "bf16" and not s.skip for s in evo)
    assert all(s.heads == 4 and s.rows == s.seqlen for s in evo if s.heads == 4)  # triangle attention: N = L rows


def test_default_llm_shapes_have_a_full_bias_of_16k_tokens():
    llm = [s for s in shapes_of() if s.family == "llm"]
    assert [(s.head_dim, s.seqlen) for s in llm] == [(64, 1024), (64, 2048), (64, 4096), (128, 1024), (128, 2048),
                                                     (128, 4096)]
    assert all(s.batch * s.seqlen == bench.TOKENS and s.heads == 16 and s.bias_batch == s.batch and s.rows == 1
               and not s.skip for s in llm)
    big = llm[2]
    assert big.bias_dims() == (4, 16, 4096, 4096) and big.bias_bytes() == 4 * 16 * 4096 * 4096 * 2


def test_llm_shapes_over_the_memory_cap_are_marked_skipped():
    shapes = shapes_of("--seqlen", "8192", "16384", "--head-dim", "64", "--bias-shapes", "llm")
    assert [(s.seqlen, bool(s.skip)) for s in shapes] == [(8192, False), (16384, True)]  # 12.9 GB, 25.8 GB
    assert shapes[1].skip == "skipped: bias + float32 dbias 25.8 GB > --bias-max-gb 16"
    assert not shapes_of("--seqlen", "16384", "--bias-shapes", "llm", "--bias-max-gb", "30")[0].skip


def test_seqlen_and_head_dim_keep_the_evoformer_defaults_with_that_l_and_d():
    evo = [s for s in shapes_of("--seqlen", "512", "--head-dim", "32") if s.family == "evoformer"]
    assert sorted((s.rows, s.seqlen, s.heads, s.head_dim) for s in evo) == [(512, 512, 4, 32), (512, 512, 8, 32)]
    llm = [s for s in shapes_of("--seqlen", "512", "--head-dim", "32") if s.family == "llm"]
    assert [(s.batch, s.seqlen, s.head_dim) for s in llm] == [(32, 512, 32)]
    assert [s.family for s in shapes_of("--bias-shapes", "evoformer", "--dtype", "fp16", "bf16")] == ["evoformer"] * 16


def test_evoformer_shapes_flag_folds_b0_groups_of_n_rows():
    shapes = shapes_of("--evoformer-shapes", "2:128:256:4:32", "64:384:8:64", "--bias-shapes", "evoformer",
                       "--seqlen", "1024")  # custom shapes are not filtered
    assert [(s.batch, s.bias_batch, s.rows, s.seqlen, s.heads, s.head_dim) for s in shapes] == [
        (256, 2, 128, 256, 4, 32), (64, 1, 64, 384, 8, 64)]
    assert str(shapes[0]) == "evoformer bf16 B0*N=2*128 L=256 H=4 D=32, bias (2, 4, 256, 256)"


@pytest.mark.parametrize("text", ["1:2:3", "a:b:c:d", "1:2:3:4:5:6", "0:256:4:32", "128:256:4:30", "128:256:4:512"])
def test_bad_evoformer_shapes_are_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError, match="evoformer shape"):
        bench.parse_evoformer(text)
    assert bench.parse_evoformer("128:256:4:32") == (1, 128, 256, 4, 32)


def test_msa_mask_flag_marks_the_evoformer_rows_only():
    shapes = shapes_of("--msa-mask", "0.7")
    assert {s.msa_keep for s in shapes if s.family == "evoformer"} == {0.7}
    assert {s.msa_keep for s in shapes if s.family == "llm"} == {None}
    assert all(s.msa_keep is None for s in shapes_of())
    evo = next(s for s in shapes if s.family == "evoformer")
    assert "MSA mask keeping 70-100 % of each row's keys" in str(evo) and evo.record("cuflash", "fwd").msa_keep == 0.7


@pytest.mark.parametrize("argv,why", [(("--bias", "--msa-mask", "0"), "must be a fraction in (0, 1]"),
                                      (("--bias", "--msa-mask", "1.5"), "must be a fraction in (0, 1]"),
                                      (("--bias", "--msa-mask", "x"), "is not a number"),
                                      (("--msa-mask", "0.7"), "the MSA mask is of the --bias evoformer rows"),
                                      (("--bias", "--bias-shapes", "llm", "--msa-mask", "0.7"),
                                       "the MSA mask is of the --bias evoformer rows")])
def test_bad_msa_mask_arguments_are_rejected(argv, why, capsys):
    with pytest.raises(SystemExit):
        bench.main(list(argv))
    assert why in capsys.readouterr().err


def test_flops_follow_the_other_modes():
    s = bench.BiasShape("evoformer", "bf16", 512, 1, 256, 8, 32)
    assert s.flops("fwd") == 4 * 512 * 8 * 256 * 256 * 32
    assert s.flops("fwd+bwd") == 3.5 * s.flops("fwd")
    assert s.bias_bytes() == 8 * 256 * 256 * 2 and s.bias_bytes(4) == 2 * s.bias_bytes()


def test_float32_rows_count_four_byte_biases():
    args = parse("--bias", "--dtype", "bf16", "fp32")
    assert args.dtype == ["bf16", "fp32"]
    shapes = shapes_of("--dtype", "fp32", "--bias-shapes", "llm", "--seqlen", "4096", "8192", "--head-dim", "64")
    assert [s.dtype for s in shapes] == ["fp32", "fp32"]
    assert shapes[0].bias_bytes() == 4 * 16 * 4096 * 4096 * 4 and shapes[0].record("cuflash", "fwd").bias_bytes == \
        shapes[0].bias_bytes()
    # the cap counts the float32 bias and its float32 dbias: 8.6 GB at N 4k, 17.2 GB at 8k
    assert [bool(s.skip) for s in shapes] == [False, True]
    assert shapes[1].skip == "skipped: bias + float32 dbias 17.2 GB > --bias-max-gb 16"


def test_to_torch_keeps_float32_arrays_as_they_are(monkeypatch):
    """The SDPA anchor's views: a float32 bias went through the 16-bit path (an int16 view of twice its keys)."""
    cupy = types.ModuleType("cupy")
    cupy.int16, cupy.float16 = np.int16, np.float16
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    fake_torch = types.SimpleNamespace(float16="f16", bfloat16="bf16", from_dlpack=lambda a: a)
    x = np.zeros((2, 3, 4, 4), np.float32)
    assert bench.to_torch(x, fake_torch) is x  # not a view of twice the elements


def test_cuflash_float32_rows_call_with_precision_fp32(monkeypatch):
    calls = []

    class FakeCuflash(types.ModuleType):
        def attention(self, q, k, v, **kw):
            calls.append(("attention", kw))

        def attention_forward(self, q, k, v, **kw):
            calls.append(("attention_forward", kw))
            return None, None

        def attention_backward(self, dout, q, k, v, o, lse, **kw):
            calls.append(("attention_backward", kw))

    monkeypatch.setitem(sys.modules, "cuflash", FakeCuflash("cuflash"))
    monkeypatch.setattr(bench, "bias_inputs", lambda shape, dtype, layout, n, seed: [("q", "k", "v", "do", "b")] * n)
    monkeypatch.setattr(bench, "n_input_sets", lambda set_bytes: 2)
    monkeypatch.setattr(bench, "CupyEvents", lambda: None)
    monkeypatch.setattr(bench, "free_memory", lambda torch=None: None)
    monkeypatch.setattr(bench, "median_ms", lambda call, n, events, reps, warmup: call(0) or 1.0)
    monkeypatch.setattr(bench, "cupy_peak_bytes", lambda call: call() or 1 << 30)
    out = []
    for dtype, want in (("fp32", {"precision": "fp32"}), ("bf16", {})):
        calls.clear()
        bench.bench_cuflash_bias(bench.BiasShape("evoformer", dtype, 4, 1, 64, 2, 32), parse("--bias"), out)
        assert {name for name, _ in calls} == {"attention", "attention_forward", "attention_backward"}
        assert all({k: kw[k] for k in kw if k == "precision"} == want and kw["bias"] == "b" for _, kw in calls)
        assert not any("key_padding_mask" in kw for _, kw in calls)
    # with the MSA mask every call gets it as key_padding_mask
    monkeypatch.setattr(bench, "msa_mask", lambda shape, seed: "kpm" if shape.msa_keep else None)
    calls.clear()
    bench.bench_cuflash_bias(bench.BiasShape("evoformer", "bf16", 4, 1, 64, 2, 32, msa_keep=0.5), parse("--bias"),
                             out)
    assert calls and all(kw["key_padding_mask"] == "kpm" for _, kw in calls)
    del out[-2:]
    # fwd+bwd's extra memory leaves out the float32 dbias it returns
    assert out[-1].extra_mem_bytes == (1 << 30) - 2 * 64 * 64 * 4 and out[1].extra_mem_bytes == (1 << 30) - 2 * 64 * 64 * 4


def test_methods_are_checked_against_the_mode(capsys):
    assert parse("--bias", "--methods", "cuflash", "sdpa-mem").methods == ["cuflash", "sdpa-mem"]
    with pytest.raises(SystemExit):
        bench.main(["--methods", "sdpa-mem"])  # the default mode has no sdpa-mem
    with pytest.raises(SystemExit):
        bench.main(["--bias", "--methods", "sdpa-flash"])
    assert "runs cuflash, sdpa-mem, plain" in capsys.readouterr().err
    args = parse("--bias", "--methods", "cuflash", "sdpa-mem")
    assert bench.bias_methods(args, torch=None) == ["cuflash"]  # no torch: no sdpa-mem
    assert bench.bias_methods(parse("--bias"), torch=object()) == ["cuflash", "sdpa-mem", "plain"]
    assert bench.bias_methods(parse("--bias", "--no-compare"), torch=None) == ["cuflash"]


def test_bias_mode_without_a_gpu_says_so(monkeypatch, capsys):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy, "is_available", lambda: False)
    assert bench.main(["--bias"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err


def test_help_describes_the_bias_mode(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for text in ("--bias ", "--bias-shapes", "--evoformer-shapes", "--bias-max-gb", "sdpa-mem", "1024:256:8:32"):
        assert text in out


# --- the methods' math without a GPU ---------------------------------------------------------------------------

class _RandomState(np.random.RandomState):
    def standard_normal(self, size=None, dtype=np.float64):  # CuPy's takes a dtype
        return super().standard_normal(size).astype(dtype)


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    """plain_forward / plain_backward / bias_inputs import cupy inside: NumPy runs the same code here."""
    fake = types.ModuleType("cupy")
    fake.__dict__.update({k: v for k, v in np.__dict__.items() if not k.startswith("__")})
    fake.random = types.SimpleNamespace(RandomState=_RandomState)
    monkeypatch.setitem(sys.modules, "cupy", fake)


def _reference(q, k, v, bias, scale, rows):
    """float64 attention of (B, H, S, D) arrays with bias (Bb, H, S, S), batch b using bias b // rows."""
    s = scale * q @ k.swapaxes(-1, -2) + np.repeat(bias, rows, axis=0)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("b0,rows", [(2, 3), (1, 4), (3, 1)])  # 5-D fold, one shared bias, full bias (llm)
def test_plain_bias_output_and_dbias(numpy_as_cupy, b0, rows):
    rng = np.random.default_rng(0)
    h, s, d, scale = 2, 5, 8, 0.3
    q, k, v, dout = (rng.standard_normal((b0 * rows, h, s, d)) for _ in range(4))
    bias = rng.standard_normal((b0, h, s, s))
    fold = lambda x: x.reshape(b0, rows, *x.shape[1:])  # noqa: E731 - as bench_plain_bias folds
    q5, k5, v5, d5 = map(fold, (q, k, v, dout))
    o, p = bench.plain_forward(q5, k5, v5, False, scale, bias[:, None])
    np.testing.assert_allclose(o.reshape(q.shape), _reference(q, k, v, bias, scale, rows), rtol=1e-12, atol=1e-12)
    dq, dk, dv, ds = bench.plain_backward(d5, q5, k5, v5, o, p, scale, return_ds=True)
    dbias = bench.plain_bias_grad(ds)
    assert dbias.shape == bias.shape
    numeric = np.empty_like(bias)  # d sum(dout * o) / d bias, central differences
    eps = 1e-6
    for idx in np.ndindex(*bias.shape):
        plus, minus = bias.copy(), bias.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric[idx] = ((_reference(q, k, v, plus, scale, rows) - _reference(q, k, v, minus, scale, rows))
                        * dout).sum() / (2 * eps)
    np.testing.assert_allclose(dbias, numeric, rtol=1e-5, atol=1e-6)  # central differences
    dq3 = bench.plain_backward(d5, q5, k5, v5, o, p, scale)  # without return_ds: (dq, dk, dv) as before
    assert len(dq3) == 3 and np.array_equal(dq3[0], dq)


def test_bias_inputs_are_the_four_arrays_and_the_bias(numpy_as_cupy):
    shape = bench.BiasShape("evoformer", "fp16", 6, 2, 16, 4, 8)
    sets = bench.bias_inputs(shape, "fp16", "bhsd", 2, seed=1)
    assert len(sets) == 2 and all(len(x) == 5 for x in sets)
    assert [a.shape for a in sets[0]] == [(6, 4, 16, 8)] * 4 + [(2, 4, 16, 16)]
    assert sets[0][4].dtype == np.float16 and not np.array_equal(sets[0][4], sets[1][4])


@pytest.mark.parametrize("keep", [0.7, 1.0, 0.01])
def test_msa_mask_keeps_a_prefix_of_each_row(numpy_as_cupy, keep):
    shape = bench.BiasShape("evoformer", "bf16", 64, 2, 50, 4, 32, msa_keep=keep)
    kpm = bench.msa_mask(shape, seed=3)
    assert kpm.shape == (64, 50) and kpm.dtype == bool
    kept = kpm.sum(axis=1)
    assert (kpm == (np.arange(50)[None, :] < kept[:, None])).all()  # a prefix
    assert kept.min() >= max(1, np.floor(keep * 50)) and kept.max() <= 50
    if keep < 1:
        assert len(set(kept.tolist())) > 1  # rows differ
    assert np.array_equal(kpm, bench.msa_mask(shape, seed=3))  # the same mask for every method of a shape
    assert bench.msa_mask(bench.BiasShape("evoformer", "bf16", 64, 2, 50, 4, 32), seed=3) is None


def test_plain_attention_with_the_msa_term_ignores_the_masked_keys(numpy_as_cupy):
    rng = np.random.default_rng(1)
    b0, rows, h, s, d, scale = 2, 3, 2, 6, 8, 0.4
    q, k, v, dout = (rng.standard_normal((b0 * rows, h, s, d)) for _ in range(4))
    bias = rng.standard_normal((b0, h, s, s))
    kpm = np.arange(s)[None, :] < np.array([4, 2, 1, 5, 3, 2])[:, None]
    term = bench.msa_term(kpm, np.float64, b0)
    assert term.shape == (b0, rows, 1, 1, s)
    fold = lambda x: x.reshape(b0, rows, *x.shape[1:])  # noqa: E731
    q5, k5, v5, d5 = map(fold, (q, k, v, dout))
    o, p = bench.plain_forward(q5, k5, v5, False, scale, bias[:, None] + term)
    for r in range(b0 * rows):  # each row: attention over its kept keys only, with its group's bias
        n = kpm[r].sum()
        sc = scale * q[r] @ k[r, :, :n].swapaxes(-1, -2) + bias[r // rows][:, :, :n]
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        want = (pr / pr.sum(-1, keepdims=True)) @ v[r, :, :n]
        np.testing.assert_allclose(o.reshape(q.shape)[r], want, rtol=1e-12, atol=1e-12)
    _, _, _, ds = bench.plain_backward(d5, q5, k5, v5, o, p, scale, return_ds=True)
    dbias = bench.plain_bias_grad(ds)
    # a key masked in every row of a group gets no gradient in that group's bias
    for g in range(b0):
        dead = ~kpm[g * rows:(g + 1) * rows].any(axis=0)
        assert dead.any() and (dbias[g][..., dead] == 0).all()


class FakeTensor:
    """The torch calls expand_bias makes (indexing, expand with -1, reshape) on a NumPy array."""

    def __init__(self, a):
        self.a, self.shape = a, a.shape

    def __getitem__(self, key):
        return FakeTensor(self.a[key])

    def expand(self, *sizes):
        sizes = tuple(n if s == -1 else s for s, n in zip(sizes, self.a.shape))
        return FakeTensor(np.broadcast_to(self.a, sizes))

    def reshape(self, *sizes):
        return FakeTensor(self.a.reshape(sizes))


@pytest.mark.parametrize("b0,rows", [(1, 6), (2, 3), (6, 1)])
def test_expand_bias_gives_batch_b_the_bias_b_over_n(b0, rows):
    bias = np.arange(b0 * 2 * 3 * 3, dtype=np.float32).reshape(b0, 2, 3, 3)
    mask = bench.expand_bias(FakeTensor(bias), b0 * rows).a
    assert mask.shape == (b0 * rows, 2, 3, 3)
    for b in range(b0 * rows):
        assert np.array_equal(mask[b], bias[b // rows])
    if b0 == 1:
        assert mask.strides[0] == 0  # a view: the bias is not copied


# --- the run loop, table and JSON with stand-in methods ----------------------------------------------------------

def fake_bench(method, tflops, mem_mib, fail_bwd=False):
    def run(shape, args, out, torch=None):
        for p in bench.BIAS_PASSES:
            if p == "fwd+bwd" and fail_bwd:
                raise ValueError("deterministic=True with a broadcast bias's dbias")
            ms = shape.flops(p) / tflops / 1e9
            out.append(shape.record(method, p, ms=ms, tflops=tflops, peak_mem_bytes=(mem_mib << 20) + 123,
                                    extra_mem_bytes=mem_mib << 20,
                                    compute_dtype="fp16" if method == "plain" else None))
    return run


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(bench, "free_memory", lambda torch=None: None)
    monkeypatch.setattr(bench, "BIAS_BENCH", {"cuflash": fake_bench("cuflash", 200.0, 10),
                                              "sdpa-mem": fake_bench("sdpa-mem", 100.0, 3000),
                                              "plain": fake_bench("plain", 50.0, 9000)})

    def attention_forward(q, k, v, *, bias=None):
        return None

    return types.SimpleNamespace(attention_forward=attention_forward, __version__="0")


def test_run_bias_times_every_shape_and_method_and_prints_the_table(stand_ins, capsys):
    args = parse("--bias", "--seqlen", "256", "16384", "--head-dim", "32")
    records = bench.run_bias(args, object(), stand_ins)
    out = capsys.readouterr().out
    ran = [r for r in records if r.ms]
    assert len(ran) == 3 * 3 * 2  # evoformer 1024:256:8:32 and 256:256:4:32, llm N=256; 3 methods, 2 passes
    assert {r.method for r in ran} == {"cuflash", "sdpa-mem", "plain"} and {r.passname for r in ran} == {
        "fwd", "fwd+bwd"}
    assert "cuflash 2.00x sdpa-mem" in out  # the per-shape line
    skipped = [r for r in records if r.note.startswith("skipped")]
    assert len(skipped) == 6 and all(r.seqlen == 16384 for r in skipped)  # over the 16 GB cap: every method, pass
    assert "bias fwd: ms, TFLOP/s (1 x 4*B*H*S^2*D)" in out and "bias fwd+bwd: ms, TFLOP/s (3.5 x" in out
    assert "ms cf    ms sdpa   ms plain |    TF cf  TF sdpa TF plain | cf/sdpa |     MiB cf   MiB sdpa  MiB plain" \
        in out
    row = next(line for line in out.splitlines() if line.startswith("evoformer bf16   1024     1   256   8  32"))
    assert "|    200.0    100.0     50.0 |    2.00 |       10.0     3000.0     9000.0*" in row
    assert "     1.0      1024 |" in row  # bias MiB (8 x 256 x 256 x 2 bytes), BHS^2 MiB (x 1024 rows)
    assert "* plain attention for this dtype was computed in fp16" in out
    assert ("skipped: llm bf16 B=1 Bb=1 S=16384 H=16 D=32 (cuflash fwd, cuflash fwd+bwd, sdpa-mem fwd, sdpa-mem "
            "fwd+bwd, plain fwd, plain fwd+bwd): bias + float32 dbias 25.8 GB > --bias-max-gb 16") in out


def test_a_method_that_fails_in_the_backward_keeps_its_forward(stand_ins, monkeypatch, capsys):
    monkeypatch.setitem(bench.BIAS_BENCH, "cuflash", fake_bench("cuflash", 200.0, 10, fail_bwd=True))
    args = parse("--bias", "--bias-shapes", "evoformer", "--seqlen", "768", "--head-dim", "32",
                 "--methods", "cuflash", "sdpa-mem")
    records = bench.run_bias(args, object(), stand_ins)
    out = capsys.readouterr().out
    cf = [(r.passname, r.batch, bool(r.ms)) for r in records if r.method == "cuflash"]
    assert cf == [("fwd", 128, True), ("fwd+bwd", 128, False), ("fwd", 768, True), ("fwd+bwd", 768, False)]
    assert "note: cuflash fwd+bwd skipped for evoformer bf16 B0*N=1*128 L=768 H=8 D=32" in out
    assert "ValueError: deterministic=True" in out
    fwd_bwd_rows = [line for line in out.splitlines() if line.startswith("evoformer") and "|" in line]
    assert any("       - " in line for line in fwd_bwd_rows)  # the cuflash fwd+bwd cells are empty


def test_json_record_of_the_bias_mode(stand_ins, monkeypatch, tmp_path, capsys):
    pytest.importorskip("cupy")
    monkeypatch.setattr(bench, "device_line", lambda cp, torch, cuflash: ("Fake GPU", types.SimpleNamespace(
        compute_capability="90")))
    path = tmp_path / "bias.json"
    args = parse("--bias", "--bias-shapes", "llm", "--seqlen", "1024", "--head-dim", "64", "--json", str(path),
                 "--no-compare")
    assert bench.main_decode_varlen(args, stand_ins, None) == 0
    data = json.loads(path.read_text())
    assert data["mode"] == "bias" and data["device"] == "Fake GPU"
    assert [(r["method"], r["passname"], r["family"], r["batch"], r["seqlen"]) for r in data["records"]] == [
        ("cuflash", "fwd", "llm", 16, 1024), ("cuflash", "fwd+bwd", "llm", 16, 1024)]
    assert data["records"][0]["extra_mem_bytes"] == 10 << 20 and data["records"][0]["bias_bytes"] == \
        16 * 16 * 1024 * 1024 * 2
    assert f"records written to {path}" in capsys.readouterr().out


def test_run_bias_with_the_msa_mask_says_so_in_its_table(stand_ins, capsys):
    args = parse("--bias", "--bias-shapes", "evoformer", "--seqlen", "256", "--head-dim", "32", "--msa-mask", "0.7")
    records = bench.run_bias(args, object(), stand_ins)
    out = capsys.readouterr().out
    assert records and all(r.msa_keep == 0.7 for r in records)
    assert "MSA mask keeping 70-100 % of each row's keys" in out  # the per-shape lines
    assert ("evoformer rows with an MSA mask: a key_padding_mask in which each row keeps its first 70-100 % of the "
            "keys (SDPA and plain: added to the bias as -inf)") in out
