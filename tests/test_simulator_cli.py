"""cuflash-sim: sweep output (the JSON fields of SWEEP_FIELDS), plots, and clear errors."""
import json
import time

import pytest

from cuflash.simulator import Problem, simulate
from cuflash.simulator.cli import SWEEP_FIELDS, main


def test_sweep_json_has_exactly_the_sweep_fields(capsys):
    rc = main(["sweep", "--strategy", "fa2", "--strategy", "cuflash", "--seqlen", "512", "1000", "--head-dim", "64",
               "--batch", "2", "--heads", "4", "--causal", "--json"])
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["strategy"], r["seqlen"]) for r in records] == [("fa2", 512), ("fa2", 1000), ("cuflash", 512),
                                                               ("cuflash", 1000)]
    for r in records:
        assert tuple(r) == SWEEP_FIELDS, f"fields {tuple(r)}"
        c = simulate(r["strategy"], Problem(2, 4, r["seqlen"], r["seqlen"], 64, "fp16", True))
        assert (r["hbm_read_bytes"], r["flops"], r["bank_conflicts"]) == (c.hbm_read_bytes, c.flops, c.bank_conflicts)


def test_sweep_with_l2_adds_dram_bytes(capsys):
    assert main(["sweep", "--strategy", "cuflash", "--seqlen", "2048", "--head-dim", "128", "--batch", "1",
                 "--heads", "8", "--l2-bytes", "50MiB", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert tuple(rec) == SWEEP_FIELDS + ("dram_bytes",)
    assert 0 < rec["dram_bytes"] < rec["hbm_read_bytes"] + rec["hbm_write_bytes"]


def test_sweep_table_is_readable(capsys):
    assert main(["sweep", "--strategy", "standard", "--strategy", "fa1", "--seqlen", "1024", "--head-dim", "64",
                 "--batch", "1", "--heads", "16", "--sram-bytes", "100K", "--backward"]) == 0
    out = capsys.readouterr().out
    assert "backward" in out and "standard" in out and "fa1" in out and "HBM read" in out


@pytest.mark.parametrize("argv,message", [
    (["sweep", "--strategy", "fa3", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1"], "invalid choice"),
    (["sweep", "--strategy", "fa2", "--seqlen", "0", "--head-dim", "64", "--batch", "1", "--heads", "1"], "positive"),
    (["sweep", "--strategy", "fa2", "--seqlen", "8", "--batch", "1", "--heads", "1"], "--head-dim"),
    (["sweep", "--strategy", "fa2", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--block-m", "64"], "--block-m and --block-n"),
    (["sweep", "--strategy", "fa1", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--sram-bytes", "lots"], "byte size"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "256", "--batch", "1", "--heads", "1",
      "--dtype", "fp64"], "head dim 128 for fp64"),
    (["plot", "hbm-vs-n", "--dtype", "fp4", "--out", "x.png"], "invalid choice"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--dtype", "e5m2"], "invalid choice"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--dtype", "fp8", "--backward"], "--backward: cuflash has no FP8 backward"),
    (["plot", "hbm-vs-n", "--dtype", "bf16", "fp8", "--backward", "--out", "x.png"], "no FP8 backward"),
    (["sweep", "--strategy", "fa2", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--dtype", "fp8"], "strategy 'cuflash' only"),
    (["plot", "hbm-vs-n", "--dtype", "fp8", "--strategy", "fa2", "--out", "x.png"], "add --strategy cuflash"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "96", "--batch", "1", "--heads", "1",
      "--dtype", "fp8"], "head_dim=96 is not supported by the FP8 forward"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "320", "--batch", "1", "--heads", "1"],
     "head_dim=320"),
    (["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--kernels", "wgmma"], "invalid choice"),
    (["sweep", "--strategy", "fa2", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--window", "-2", "0"], "a window side must be >= 0, or -1"),
    (["sweep", "--strategy", "fa2", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
      "--window", "16"], "--window: expected 2 arguments"),
    (["plot", "hbm-vs-n"], "--out"),
    (["plot", "roofline", "--out", "x.png"], "invalid choice"),
])
def test_bad_arguments_exit_nonzero_with_a_message(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    assert message in capsys.readouterr().err


def test_plot_hbm_vs_n_is_fast_and_writes_a_png(tmp_path):
    out = tmp_path / "hbm.png"
    main(["plot", "hbm-vs-n", "--out", str(out)])  # warm-up (Numba cache, matplotlib)
    t0 = time.perf_counter()
    assert main(["plot", "hbm-vs-n", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert elapsed < 10, f"plot hbm-vs-n took {elapsed:.1f} s (limit: 10 s warm)"


def test_plot_block_size_writes_a_png(tmp_path):
    out = tmp_path / "bs.png"
    assert main(["plot", "block-size", "--out", str(out), "--blocks", "32", "128", "512"]) == 0
    assert out.stat().st_size > 10_000


def test_unwritable_output_is_an_error(tmp_path, capsys):
    assert main(["plot", "block-size", "--out", str(tmp_path / "missing" / "x.png"), "--blocks", "64"]) != 0
    assert "cannot write" in capsys.readouterr().err


def test_sweep_deterministic_backward(capsys):
    argv = ["sweep", "--strategy", "fa2", "--strategy", "cuflash", "--seqlen", "1000", "--head-dim", "64",
            "--batch", "1", "--heads", "2", "--backward", "--json"]
    assert main(argv) == 0 and main(argv + ["--deterministic"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert recs[0] == recs[2], "--deterministic changes nothing for fa2"
    p = Problem(1, 2, 1000, 1000, 64)
    assert recs[3]["hbm_write_bytes"] == simulate("cuflash", p, backward=True, deterministic=True).hbm_write_bytes
    # bwd_sm90_ws_kernel's ordered dQ: the default traffic plus, per head, the preprocess's 1024 / 64 int32
    # counters and a 4-byte add per visit (8 key blocks x 8 query blocks of 128), an atomic (a read and a write)
    assert recs[3]["hbm_write_bytes"] == recs[1]["hbm_write_bytes"] + 2 * (1024 // 64 * 4 + 8 * 8 * 4)
    assert recs[3]["hbm_read_bytes"] == recs[1]["hbm_read_bytes"] + 2 * 8 * 8 * 4
    assert recs[1]["bank_conflicts"] == simulate("cuflash", p, backward=True).bank_conflicts


def test_sweep_deterministic_wide_backward(capsys):
    """fp64, deterministic: the ordered bwd_wide_kernel on its 32 x 64 tiles at head dim 64 (sm_90a)."""
    argv = ["sweep", "--strategy", "cuflash", "--seqlen", "256", "--head-dim", "64", "--batch", "1", "--heads", "2",
            "--dtype", "fp64", "--causal", "--backward", "--json"]
    assert main(argv + ["--deterministic"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["block_m"], rec["block_n"]) == (32, 64)
    # per head: the preprocess's delta, lse_log2, dq_accum (256 padded rows, float64) and 256 / 16 int32 counters;
    # dK, dV; per visit (causal, 4 key blocks x 8 query blocks, key block n seen by query blocks 2n..7: 8 + 6 + 4 + 2)
    # the 32 x 64 dQ tile's float64 atomics and the counter's 4-byte add; dQ
    per_head = (2 * 256 * 8 + 256 * 64 * 8 + 16 * 4) + 2 * 256 * 64 * 8 + 20 * (32 * 64 * 8 + 4) + 256 * 64 * 8
    assert rec["hbm_write_bytes"] == 2 * per_head


def test_deterministic_needs_backward(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--strategy", "cuflash", "--seqlen", "8", "--head-dim", "64", "--batch", "1", "--heads", "1",
              "--deterministic"])
    assert e.value.code != 0 and "--backward" in capsys.readouterr().err


def test_sweep_counts_the_kernel_family_asked_for(capsys):
    """--kernels auto (default): what the library launches on an H100 (the wgmma kernels where the head dim
    has one); --kernels mma: the mma.sync kernels. The other strategies ignore it."""
    from cuflash import config

    argv = ["sweep", "--strategy", "cuflash", "--strategy", "fa2", "--seqlen", "1024", "--head-dim", "64",
            "--batch", "1", "--heads", "16", "--json"]
    assert main(argv) == 0 and main(argv + ["--kernels", "mma"]) == 0 and main(argv + ["--kernels", "auto"]) == 0
    auto, fa2, mma, fa2_mma, auto2, _ = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert auto == auto2 and fa2 == fa2_mma
    p = Problem(1, 16, 1024, 1024, 64)
    for rec, kernels in ((auto, "auto"), (mma, "mma")):
        c = simulate("cuflash", p, kernels=kernels)
        cfg = config.forward_kernel_config(64, "fp16", False, kernels=kernels, seqlen_k=1024)
        assert (rec["block_m"], rec["block_n"]) == (cfg.block_m, cfg.block_n)
        assert (rec["hbm_read_bytes"], rec["sram_read_bytes"]) == (c.hbm_read_bytes, c.sram_read_bytes)
    assert auto["sram_read_bytes"] != mma["sram_read_bytes"], "the two families read shared memory differently"
    assert main(["sweep", "--strategy", "cuflash", "--seqlen", "1024", "--head-dim", "64", "--batch", "1",
                 "--heads", "1", "--kernels", "mma"]) == 0
    assert "cuflash: mma.sync kernels" in capsys.readouterr().out


def test_sweep_with_a_window_counts_the_windowed_problem(capsys):
    assert main(["sweep", "--strategy", "fa2", "--strategy", "cuflash", "--seqlen", "4096", "--head-dim", "64",
                 "--batch", "1", "--heads", "2", "--causal", "--window", "256", "-1", "--backward", "--json"]) == 0
    for r in (json.loads(line) for line in capsys.readouterr().out.splitlines()):
        c = simulate(r["strategy"], Problem(1, 2, 4096, 4096, 64, "fp16", True, (256, -1)), backward=True)
        full = simulate(r["strategy"], Problem(1, 2, 4096, 4096, 64, "fp16", True), backward=True)
        assert (r["hbm_read_bytes"], r["flops"]) == (c.hbm_read_bytes, c.flops)
        assert r["hbm_read_bytes"] < full.hbm_read_bytes / 4, "the window skips most tiles"
    assert main(["sweep", "--strategy", "fa2", "--seqlen", "1024", "--head-dim", "64", "--batch", "1", "--heads", "1",
                 "--window", "128", "128"]) == 0
    assert "window (128, 128)" in capsys.readouterr().out


def test_plot_hbm_vs_n_draws_windowed_lines(tmp_path):
    out = tmp_path / "hbm_window.png"
    t0 = time.perf_counter()
    assert main(["plot", "hbm-vs-n", "--causal", "--window", "1024", "0", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert elapsed < 20, f"plot hbm-vs-n --window took {elapsed:.1f} s"


def test_sweep_counts_the_fp8_forward(capsys):
    """--dtype fp8: cuflash's FP8 forward (fwd_sm90_fp8_kernel), what simulate counts, for one dtype or beside
    another strategy's refusal."""
    argv = ["sweep", "--strategy", "cuflash", "--seqlen", "1000", "4096", "--head-dim", "128", "--batch", "2",
            "--heads", "4", "--dtype", "fp8", "--causal"]
    assert main(argv + ["--json"]) == 0
    for rec in (json.loads(line) for line in capsys.readouterr().out.splitlines()):
        c = simulate("cuflash", Problem(2, 4, rec["seqlen"], rec["seqlen"], 128, "fp8", True))
        assert (rec["block_m"], rec["block_n"]) == (c.block_m, c.block_n)
        assert (rec["hbm_read_bytes"], rec["hbm_write_bytes"], rec["sram_read_bytes"], rec["flops"],
                rec["bank_conflicts"]) == (c.hbm_read_bytes, c.hbm_write_bytes, c.sram_read_bytes, c.flops,
                                           c.bank_conflicts), rec
    assert main(argv) == 0
    assert "forward, d=128, batch=2, heads=4, fp8, causal" in capsys.readouterr().out


def test_plot_hbm_vs_n_draws_fp8_beside_bf16(tmp_path, monkeypatch):
    """--dtype bf16 fp8: every strategy in bf16 and cuflash's FP8 forward (the paper strategies have no fp8
    line), each point what simulate counts."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    out = tmp_path / "hbm_fp8.png"
    ns = [256, 1024, 4096]
    assert main(["plot", "hbm-vs-n", "--dtype", "bf16", "fp8", "--head-dim", "128", "--seqlen", *map(str, ns),
                 "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in figures[0].axes[0].get_lines()}
    assert [k.split(" (")[0] for k in lines if "slope" not in k] == \
        ["standard bf16", "fa1 bf16", "fa2 bf16", "cuflash bf16", "cuflash fp8"], f"lines: {list(lines)}"
    fp8 = lines["cuflash fp8 (B_r=128, B_c=128)"]
    assert fp8 == [simulate("cuflash", Problem(1, 1, n, n, 128, "fp8")).hbm_bytes for n in ns]
    bf16 = next(y for k, y in lines.items() if k.startswith("cuflash bf16"))
    assert all(y8 < y16 for y8, y16 in zip(fp8, bf16)), "FP8 moves fewer bytes"
