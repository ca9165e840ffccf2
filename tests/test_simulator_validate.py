"""The ncu validation script, without a GPU: CSV parsing, predictions, and a whole run against a fake ncu."""
import json
import stat
import sys

import pytest

from cuflash.simulator import simulate, validate

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(metric, unit, value, kid="0"):
    return (f'"{kid}","4242","python","host","void cuflash::fwd_kernel<cuflash::FwdTraits<64, 128, 128, 8, 2, '
            f'cuflash::f16>, false>(cuflash::FwdParams)","1","7","(256, 1, 1)","(16, 16, 2)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_csv_parser_reads_ncu_rows_among_other_output():
    text = "\n".join([
        "==PROF== Connected to process 4242 (python)",
        "==PROF== Profiling \"fwd_kernel\": 0%....50%....100% - 9 passes",
        "cuflash-validate-driver: ok 0.79",
        HEADER,
        _row("l1tex__m_xbar2l1tex_read_bytes.sum", "byte", "276,824,064"),
        _row("dram__bytes_read.sum", "Mbyte", "25.17"),
        _row("smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum", "", "0"),
        _row("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "61.5"),
        _row("launch__grid_size", "", "512"),
        _row("gpu__time_duration.sum", "usecond", "1,234.5"),
        _row("l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum", "byte", "n/a"),
        "==PROF== Disconnected from process 4242",
    ])
    got = validate.parse_ncu_csv(text)
    assert list(got) == ["0"], f"one kernel ID expected, got {list(got)}"
    m = got["0"]
    assert m["l1tex__m_xbar2l1tex_read_bytes.sum"] == 276_824_064, "thousands separators must be removed"
    assert m["dram__bytes_read.sum"] == pytest.approx(25.17e6), "Mbyte must be converted to bytes"
    assert m["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"] == 61.5
    assert m["launch__grid_size"] == 512
    assert m["gpu__time_duration.sum"] == pytest.approx(1_234_500), "usecond must be converted to ns"
    assert "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum" not in m, "'n/a' must be skipped, not parsed as 0"


@pytest.mark.parametrize("text,value", [("1,234,567", 1234567.0), ("12.5", 12.5), ("0", 0.0), ("1,234.75", 1234.75),
                                        ("12,5", 12.5), ("n/a", None), ("", None)])
def test_number_parser(text, value):
    assert validate.parse_number(text) == value, f"parse_number({text!r})"


def test_csv_parser_without_rows_returns_empty():
    assert validate.parse_ncu_csv("==ERROR== Failed to find metric foo\n") == {}


@pytest.mark.parametrize("case", validate.CASES["full"], ids=lambda c: c.name)
def test_predicted_global_reads_equal_the_strategy_counts(case):
    """Every validated head dim has sector-aligned rows, so the sector count equals the byte count."""
    reads, writes = validate.predicted_global_bytes(case)
    c = simulate("cuflash", case.problem())
    assert reads == c.hbm_read_bytes, f"{case.name}: sector reads {reads} != counted {c.hbm_read_bytes}"
    assert writes >= c.hbm_write_bytes, f"{case.name}: sector writes {writes} < bytes {c.hbm_write_bytes}"


FAKE_NCU = r'''
import sys
args = sys.argv[1:]
if "--version" in args:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2025.3.0.0 (fake)")
    sys.exit(0)
metrics = args[args.index("--metrics") + 1].split(",")
values = {values}
reject = {reject!r}
if reject in metrics and len(metrics) > 1:
    print("==ERROR== Failed to find metric " + reject, file=sys.stderr)
    sys.exit(1)
if reject in metrics:
    print("==ERROR== Failed to find metric " + reject, file=sys.stderr)
    sys.exit(1)
print("==PROF== Connected to process 1 (python)")
print({header!r})
for m in metrics:
    v = values.get(m, 1)
    print(",".join('"%s"' % x for x in ["1", "1", "python", "h", "fwd_kernel", "1", "7", "(256, 1, 1)", "(16, 16, 2)",
                                        "0", "9.0", "Command line profiler metrics", m, "byte", "{{:,}}".format(v)]))
'''


def _fake_ncu(tmp_path, values, reject="none"):
    path = tmp_path / "ncu"
    path.write_text(f"#!{sys.executable}\n" + FAKE_NCU.format(values=values, reject=reject, header=HEADER))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_whole_run_against_a_fake_ncu_drops_unknown_metrics(tmp_path):
    case = validate.CASES["quick"][0]
    pred = validate.predict(case, validate.H100_L2_BYTES, validate.H100_SMS)
    values = {m: int(v) for m, (v, _) in pred.items() if v is not None}
    rejected = "smsp__sass_inst_executed_op_ldgsts.sum"
    ncu = _fake_ncu(tmp_path, values, reject=rejected)
    out = tmp_path / "IO_VALIDATION.md"
    raw = tmp_path / "raw"
    rc = validate.main(["--out", str(out), "--cases", "quick", "--only", "0", "--ncu", ncu, "--timeout", "60",
                        "--raw-dir", str(raw)])
    assert rc == 0
    text = out.read_text()
    assert "| NO |" not in text, f"a fake ncu that echoes the predictions must meet every target:\n{text}"
    assert rejected in text.split("| config |")[0], "the rejected metric must be listed as dropped"
    rows = json.loads((raw / "rows.json").read_text())
    met = {r["metric"]: r["verdict"] for r in rows}
    assert met["l1tex__m_xbar2l1tex_read_bytes.sum"] == "yes"
    assert met[rejected] == "pending", "a dropped metric has no measurement"
    assert any(p.name.endswith(".stdout.txt") for p in raw.iterdir())
    # the kept raw output rebuilds the same table without ncu
    out2 = tmp_path / "again.md"
    assert validate.main(["--out", str(out2), "--cases", "quick", "--only", "0", "--from-raw", str(raw),
                          "--raw-dir", str(tmp_path / "raw2")]) == 0
    assert out2.read_text().split("| config |")[1] == text.split("| config |")[1]


def test_missing_ncu_is_a_clear_error(tmp_path, capsys):
    rc = validate.main(["--out", str(tmp_path / "x.md"), "--ncu", str(tmp_path / "no-ncu"), "--raw-dir", str(tmp_path)])
    assert rc == 2 and "ncu not found" in capsys.readouterr().err
