"""Validate the analyzer against hardware counters: ncu on cuflash's forward kernel.

    PYTHONPATH=. python -m cuflash.simulator.validate --out docs/IO_VALIDATION.md

For each configuration this launches a small driver (`python -c ...`: random CuPy inputs, one warm-up
call of cuflash.attention_forward, one profiled call) under

    ncu --cache-control all --clock-control none --print-units base --csv
        --kernel-name regex:fwd_kernel --launch-skip 1 --launch-count 1 --metrics <METRICS>

parses ncu's CSV, and compares each metric with the analyzer's prediction for the same config. Raw ncu
output and the rows as JSON are kept in out/ncu_raw/ (git-ignored; `--raw-dir`) so the table can be
rebuilt without the GPU (`--from-raw out/ncu_raw`). A metric
that this ncu does not know is dropped after probing the metrics one by one (printed, and listed in
the document), so one bad name does not lose the run. `--dry-run` prints the predictions and the ncu
commands without running anything.

Targets (issue 4): L2->SM read bytes within 2% of the predicted global reads; shared wavefronts and
bank conflicts of ld/st and ldmatrix exactly equal; cp.async wavefronts and DRAM bytes (L2 model)
within 10%.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cuflash import config as _config

from . import banks
from .model import H100_L2_BYTES, H100_SMS, STAT_BYTES, Problem
from .strategies import block_sizes, n_block_max, simulate

SECTOR = 32


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False

    @property
    def name(self) -> str:
        seq = f"{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        return (f"b{self.batch} h{self.heads} N{seq} d{self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''}")

    def problem(self) -> Problem:
        return Problem(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.dtype, self.causal)

    def config(self):
        return _config.fwd_config(_config.kernel_head_dim(self.head_dim), self.dtype, self.causal)


# Chosen to cover: both panel widths (d = 96 uses 64-byte panels), every tile shape in FWD_TILES,
# tails (1000 x 1500), causal with Sq > Sk (CTAs that see no key), K/V working sets below and above
# the L2 size, and bf16.
CASES = {
    "quick": [
        Case(2, 16, 2048, 2048, 64),
        Case(2, 8, 1000, 1500, 96, causal=True),
    ],
    "full": [
        Case(2, 16, 2048, 2048, 64),
        Case(2, 16, 2048, 2048, 64, causal=True),
        Case(1, 16, 4096, 4096, 128, "bf16", causal=True),
        Case(4, 8, 1000, 1500, 96),
        Case(2, 8, 1000, 1500, 96, causal=True),
        Case(2, 8, 1024, 1024, 256),
        Case(1, 8, 1536, 512, 64, causal=True),
        Case(8, 16, 512, 512, 32),
        Case(1, 32, 16384, 16384, 128),
    ],
}

# metric -> (what it is, target): "exact", a relative tolerance, or None (reported only)
METRICS = {
    "l1tex__m_xbar2l1tex_read_bytes.sum": ("L2->SM read bytes (global loads)", 0.02),
    "l1tex__m_l1tex2xbar_write_bytes.sum": ("SM->L2 write bytes (global stores)", 0.02),
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": ("local-memory store bytes (spills)", "exact"),
    "dram__bytes_read.sum": ("DRAM read bytes (L2 model)", 0.10),
    "dram__bytes_write.sum": ("DRAM write bytes", None),
    "smsp__inst_executed_op_shared_ld.sum": ("shared load instructions", "exact"),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": ("shared load wavefronts (LDS + LDSM)", "exact"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("shared load bank conflicts", "exact"),
    "smsp__inst_executed_op_shared_st.sum": ("shared store instructions (STS)", "exact"),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": ("shared store wavefronts", "exact"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("shared store bank conflicts", "exact"),
    "smsp__inst_executed_op_ldsm.sum": ("ldmatrix instructions", "exact"),
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum": ("ldmatrix wavefronts", "exact"),
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum": ("ldmatrix bank conflicts", "exact"),
    "smsp__sass_inst_executed_op_ldgsts.sum": ("cp.async (LDGSTS) instructions", "exact"),
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum": ("cp.async shared wavefronts (model)", 0.10),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("tensor pipe active (% of peak)", None),
    "gpu__time_duration.sum": ("kernel duration (ns)", None),
    "launch__grid_size": ("CTAs", "exact"),
    "launch__block_size": ("threads per CTA", "exact"),
}

_UNIT_SCALE = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "kib": 1024, "mib": 2 ** 20,
               "gib": 2 ** 30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "nsecond": 1, "usecond": 1e3,
               "msecond": 1e6, "second": 1e9}


# ----------------------------------------------------------------------------------------------
# ncu CSV
# ----------------------------------------------------------------------------------------------

def parse_number(text: str) -> float | None:
    """A metric value from ncu's CSV: '1,234,567' (thousands separators), '12.5', 'n/a' -> None."""
    t = text.strip().replace("\u202f", "").replace(" ", "")
    if not t or t.lower() in ("n/a", "na", "-", "nan"):
        return None
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    elif "," in t and "." not in t and re.fullmatch(r"[+-]?\d+,\d+", t):
        t = t.replace(",", ".")  # a decimal comma (some locales), e.g. '12,5'
    try:
        return float(t)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> dict[str, dict[str, float]]:
    """{kernel ID: {metric name: value in base units}} from `ncu --csv` output mixed with other lines.

    Rows: "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",
    "Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value". Units such as
    Kbyte/Mbyte are converted to bytes (in case --print-units base was not honoured)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    header_at = next((i for i, ln in enumerate(lines) if '"Metric Name"' in ln and '"ID"' in ln), None)
    if header_at is None:
        return {}
    reader = csv.reader(io.StringIO("\n".join(lines[header_at:])))
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    need = ("ID", "Metric Name", "Metric Value")
    if any(n not in col for n in need):
        return {}
    out: dict[str, dict[str, float]] = {}
    for row in reader:
        if len(row) != len(header) or row[col["ID"]] == "ID":
            continue
        value = parse_number(row[col["Metric Value"]])
        if value is None:
            continue
        unit = row[col["Metric Unit"]].strip().lower() if "Metric Unit" in col else ""
        value *= _UNIT_SCALE.get(unit, 1)
        out.setdefault(row[col["ID"]], {})[row[col["Metric Name"]].strip()] = value
    return out


# ----------------------------------------------------------------------------------------------
# Predictions
# ----------------------------------------------------------------------------------------------

def predicted_global_bytes(case: Case) -> tuple[int, int]:
    """(read, write) bytes between SMs and L2 at 32-byte sector granularity, fwd_kernel's accesses.

    Rows of Q, K, V, O are head_dim*elem_bytes contiguous bytes at a row stride of heads*head_dim
    elements (contiguous bshd inputs); lse rows are 4 bytes, contiguous per (batch, head), written by the
    t == 0 lanes (8 rows per warp instruction) or, in a CTA that sees no key, 32 rows per instruction."""
    p, cfg = case.problem(), case.config()
    e, d, h = p.elem_bytes, p.head_dim, p.heads
    row_bytes = d * e

    def rows_sectors(rows_total_per_bh: int) -> int:  # every row of every (b, h) once
        b = np.arange(p.batch)[:, None, None]
        hh = np.arange(h)[None, :, None]
        r = np.arange(rows_total_per_bh)[None, None, :]
        start = ((b * rows_total_per_bh + r) * h + hh) * row_bytes
        return int(((start + row_bytes - 1) // SECTOR - start // SECTOR + 1).sum())

    # per (b, h): Q rows once per live CTA, K/V rows once per visited tile, O rows once
    n_max = n_block_max(p, cfg.block_m, cfg.block_n)
    q_rows = int((block_sizes(p.seqlen_q, cfg.block_m) * (n_max > 0)).sum())
    kv_rows = int(np.minimum(n_max * cfg.block_n, p.seqlen_k).sum())
    per_row = -(-row_bytes // SECTOR) if (row_bytes % SECTOR == 0 and (h * row_bytes) % SECTOR == 0) else None
    if per_row is not None:  # every row starts on a sector boundary
        reads = (q_rows + 2 * kv_rows) * per_row * p.batch_heads * SECTOR
        o_writes = p.seqlen_q * per_row * p.batch_heads * SECTOR
    else:  # unaligned rows: average sectors per row from the actual addresses
        avg_q = rows_sectors(p.seqlen_q) / (p.seqlen_q * p.batch_heads)
        avg_k = rows_sectors(p.seqlen_k) / (p.seqlen_k * p.batch_heads)
        reads = int(round((q_rows * avg_q + 2 * kv_rows * avg_k) * p.batch_heads * SECTOR))
        o_writes = rows_sectors(p.seqlen_q) * SECTOR
    # lse: warp instructions (mt, half) of 8 lanes (rows g) or, zero CTAs, 32 consecutive rows; each
    # instruction writes consecutive rows, so its sectors are last // 32 - first // 32 + 1
    rows_q = block_sizes(p.seqlen_q, cfg.block_m)
    lse_sectors = 0
    for m_block, (rq, n) in enumerate(zip(rows_q, n_max)):
        group = 8 if n > 0 else 32
        g0 = np.arange(0, rq, group)
        first_row = m_block * cfg.block_m + g0
        last_row = m_block * cfg.block_m + np.minimum(g0 + group, rq) - 1
        base = (np.arange(p.batch_heads) * p.seqlen_q * STAT_BYTES)[:, None]
        first, last = base + first_row * STAT_BYTES, base + last_row * STAT_BYTES + STAT_BYTES - 1
        lse_sectors += int((last // SECTOR - first // SECTOR + 1).sum())
    return reads, o_writes + lse_sectors * SECTOR


def predict(case: Case, l2_bytes: int, num_sms: int) -> dict[str, tuple[float | None, str]]:
    """{metric: (predicted value or None, note)} for one case."""
    p, cfg = case.problem(), case.config()
    walk = banks.fwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim)
    lds, ldsm, sts, ldgsts = (walk.by_sass(s) for s in ("LDS", "LDSM", "STS", "LDGSTS"))
    counts = simulate("cuflash", p, l2_bytes=l2_bytes, num_sms=num_sms)
    reads, writes = predicted_global_bytes(case)
    grid = cfg.grid(p.batch, p.heads, p.seqlen_q)
    return {
        "l1tex__m_xbar2l1tex_read_bytes.sum": (reads, "Q once per CTA, K and V once per visited tile"),
        "l1tex__m_l1tex2xbar_write_bytes.sum": (writes, "O and lse once (32-byte sectors)"),
        "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": (0, "the kernels are spill-free"),
        "dram__bytes_read.sum": (counts.dram_read_bytes, f"LRU L2 of {l2_bytes / 2**20:.0f} MiB, {num_sms} SMs"),
        "dram__bytes_write.sum": (counts.dram_write_bytes,
                                  "model incl. the final write-back; ncu sees only evictions during the kernel"),
        "smsp__inst_executed_op_shared_ld.sum": (lds.instructions + ldsm.instructions,
                                                 f"LDS + LDSM; LDS alone = {lds.instructions}"),
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": (lds.wavefronts + ldsm.wavefronts,
                                                                 f"LDS {lds.wavefronts} + LDSM {ldsm.wavefronts}"),
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": (lds.conflicts + ldsm.conflicts,
                                                                     f"LDS {lds.conflicts} + LDSM {ldsm.conflicts}"),
        "smsp__inst_executed_op_shared_st.sum": (sts.instructions, "st.shared.b32 of the O epilogue"),
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": (sts.wavefronts,
                                                                 f"STS only; + LDGSTS would be {sts.wavefronts + ldgsts.wavefronts}"),
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": (sts.conflicts, "STS only"),
        "smsp__inst_executed_op_ldsm.sum": (ldsm.instructions, "ldmatrix.x4 of Q, K, V"),
        "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum": (ldsm.wavefronts, ""),
        "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum": (ldsm.conflicts, ""),
        "smsp__sass_inst_executed_op_ldgsts.sum": (ldgsts.instructions, "Q once, K and V per tile, zero-fill included"),
        "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum": (
            ldgsts.wavefronts, "model: max(bank rule, 128-byte lines) per 8 lanes"),
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": (None, "measured only"),
        "gpu__time_duration.sum": (None, "measured only"),
        "launch__grid_size": (grid[0] * grid[1] * grid[2], f"grid {grid}"),
        "launch__block_size": (cfg.threads, f"{cfg.num_warps} warps"),
    }


# ----------------------------------------------------------------------------------------------
# Running ncu
# ----------------------------------------------------------------------------------------------

DRIVER = r"""
import sys
import numpy as np, cupy as cp, cuflash
b, h, sq, sk, d, causal, dtype = {args!r}
if dtype == "bf16":
    import ml_dtypes
    dt = ml_dtypes.bfloat16
else:
    dt = np.float16
rs = cp.random.RandomState(0)
q = rs.standard_normal((b, sq, h, d), dtype=cp.float32).astype(dt)
k = rs.standard_normal((b, sk, h, d), dtype=cp.float32).astype(dt)
v = rs.standard_normal((b, sk, h, d), dtype=cp.float32).astype(dt)
for _ in range(2):  # warm-up (compiles), then the profiled launch
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
cp.cuda.runtime.deviceSynchronize()
print("cuflash-validate-driver: ok", float(cp.abs(o.astype(cp.float32)).mean()), file=sys.stderr)
"""


def driver_code(case: Case) -> str:
    return DRIVER.format(args=(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.head_dim, case.causal,
                               case.dtype))


def ncu_command(ncu: str, case: Case, metrics: list[str], print_units: bool = True) -> list[str]:
    cmd = [ncu, "--target-processes", "all", "--cache-control", "all", "--clock-control", "none", "--csv",
           "--kernel-name", "regex:fwd_kernel", "--launch-skip", "1", "--launch-count", "1",
           "--metrics", ",".join(metrics)]
    if print_units:
        cmd[1:1] = ["--print-units", "base"]
    return cmd + [sys.executable, "-c", driver_code(case)]


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the source tree (cuflash/ and simulator/ live here)
    import cuflash

    pkg_parent = str(Path(cuflash.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([pkg_parent, root] + env.get("PYTHONPATH", "").split(os.pathsep)))
    return env


def _run(cmd: list[str], timeout: int) -> tuple[int, str, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, f"timed out after {timeout} s"
    except OSError as e:
        return 127, "", f"cannot run {cmd[0]}: {e}"


class Profiler:
    """Runs ncu per case; finds out once which metrics this ncu accepts; keeps raw output."""

    def __init__(self, ncu: str, raw_dir: Path, timeout: int, log=print):
        self.ncu, self.raw_dir, self.timeout, self.log = ncu, raw_dir, timeout, log
        self.metrics = list(METRICS)
        self.dropped: dict[str, str] = {}
        self.print_units = True
        raw_dir.mkdir(parents=True, exist_ok=True)

    def _profile(self, case: Case, metrics: list[str], tag: str) -> tuple[dict, str]:
        cmd = ncu_command(self.ncu, case, metrics, self.print_units)
        rc, out, err = _run(cmd, self.timeout)
        stem = _stem(case, tag)
        (self.raw_dir / f"{stem}.stdout.txt").write_text(out)
        (self.raw_dir / f"{stem}.stderr.txt").write_text(f"$ {shlex.join(cmd[:-1])} <driver>\nrc={rc}\n{err}")
        ids = parse_ncu_csv(out)
        if not ids:
            msgs = [ln for ln in (out + "\n" + err).splitlines() if "==ERROR==" in ln or "==WARNING==" in ln]
            last = msgs or err.strip().splitlines() or out.strip().splitlines() or ["no output"]
            return {}, f"rc={rc}; " + " / ".join(last[-3:])[:400]
        first = sorted(ids, key=lambda x: int(x) if x.isdigit() else 0)[0]
        return ids[first], ""

    def measure(self, case: Case) -> tuple[dict, str]:
        measured, error = self._profile(case, self.metrics, "all")
        if measured or not self.metrics:
            return measured, error
        if self.print_units:  # an older ncu without --print-units?
            self.print_units = False
            measured, error2 = self._profile(case, self.metrics, "all_nounits")
            if measured:
                self.log("  note: ncu rejected --print-units base; units are converted from the CSV")
                return measured, ""
            self.print_units = True
        if not re.search(r"metric", error, re.I):
            return {}, error  # the driver or the filter failed, not a metric name: probing would not help
        # probe metric by metric once: keep the ones this ncu accepts
        self.log(f"  ncu failed with all metrics ({error}); probing them one by one")
        good, merged = [], {}
        for m in self.metrics:
            one, err = self._profile(case, [m], "probe_" + m.split(".")[0])
            if m in one:
                good.append(m)
                merged.update(one)
            else:
                self.dropped[m] = err or "not reported"
                self.log(f"  dropped {m}: {self.dropped[m]}")
        self.metrics = good
        return merged, "" if merged else error


# ----------------------------------------------------------------------------------------------
# Comparison and report
# ----------------------------------------------------------------------------------------------

@dataclass
class Row:
    case: str
    metric: str
    what: str
    predicted: float | None
    measured: float | None
    target: object
    note: str

    @property
    def error(self) -> float | None:
        if self.predicted is None or self.measured is None:
            return None
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.predicted) / self.predicted

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        if self.measured is None:
            return "pending" if self.predicted is not None else "-"
        if self.predicted is None:
            return "-"
        if self.target == "exact":
            return "yes" if round(self.measured) == round(self.predicted) else "NO"
        return "yes" if abs(self.error) <= self.target else "NO"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.2f}"


def _fmt_err(r: Row) -> str:
    e = r.error
    if e is None:
        return "-"
    if r.target == "exact":
        return f"{r.measured - r.predicted:+,.0f}"
    return "inf" if e == float("inf") else f"{100 * e:+.2f}%"


def _target(t) -> str:
    return {"exact": "exact", None: "-"}.get(t, f"±{100 * t:.0f}%" if isinstance(t, float) else str(t))


def markdown(rows: list[Row], header: dict, dropped: dict, failures: dict) -> str:
    lines = [
        "# IO validation: analyzer predictions against ncu counters",
        "",
        "Generated by `python -m cuflash.simulator.validate` (simulator/validate.py); do not edit the tables",
        "by hand, re-run the script (or `--from-raw` on the kept ncu output).",
        "",
        "What is compared, per configuration of `fwd_kernel` (one profiled launch after one warm-up, caches",
        "flushed by `--cache-control all`, clocks not locked by `--clock-control none`):",
        "",
        "* global traffic: `l1tex__m_xbar2l1tex_read_bytes` (L2 -> SM) is what the kernel's global loads",
        "  become; the L2 absorbs K/V re-reads, so `dram__bytes_read` is compared with the LRU L2 model",
        "  instead. Stores: `l1tex__m_l1tex2xbar_write_bytes` (spills would add local stores; expected 0).",
        "* shared memory: every instruction of the kernel walked by `banks.fwd_kernel_shared` with the",
        "  hardware bank rule (DESIGN.md section 6). `..._op_ld` counts LDS and LDSM together; LDSM also",
        "  has its own counters. cp.async (LDGSTS) wavefronts follow an undocumented rule that the analyzer",
        "  models (see simulator/banks.py); its conflict counter always reads 0, so only wavefronts are compared.",
        "* error = (measured - predicted) / predicted, or measured - predicted for exact counts.",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines.append("")
    if dropped:
        lines.append("Metrics this ncu did not accept (dropped): " + ", ".join(f"`{m}` ({e})" for m, e in dropped.items()))
        lines.append("")
    if failures:
        lines.append("Configurations without measurements:")
        lines += [f"- {c}: {e}" for c, e in failures.items()]
        lines.append("")
    lines += ["| config | metric | predicted | measured | error | target | met | note |",
              "|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.what}<br>`{r.metric}` | {_fmt(r.predicted)} | {_fmt(r.measured)} | "
                     f"{_fmt_err(r)} | {_target(r.target)} | {r.verdict} | {r.note} |")
    met = [r for r in rows if r.verdict in ("yes", "NO")]
    missed = [r for r in met if r.verdict == "NO"]
    lines += ["", f"Targets met: {len(met) - len(missed)} of {len(met)} compared rows."]
    if missed:
        lines += ["", "Missed targets (explain each below when the document is reviewed):"]
        lines += [f"- {r.case}: {r.what}: predicted {_fmt(r.predicted)}, measured {_fmt(r.measured)} ({_fmt_err(r)})"
                  for r in missed]
    return "\n".join(lines) + "\n"


def _print_table(rows: list[Row]) -> None:
    head = ("config", "metric", "predicted", "measured", "error", "target", "met")
    data = [(r.case, r.what, _fmt(r.predicted), _fmt(r.measured), _fmt_err(r),
             _target(r.target), r.verdict) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *data)] if data else [len(h) for h in head]
    for row in [head, tuple("-" * w for w in widths)] + data:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))


def _stem(case: Case, tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{case.name}_{tag}")


def read_raw(raw_dir: Path, case: Case) -> dict:
    """Measurements of one case from kept ncu output (the full run, else the per-metric probes)."""
    merged = {}
    for f in sorted(raw_dir.glob(_stem(case, "") + "*.stdout.txt")):
        ids = parse_ncu_csv(f.read_text())
        if ids:
            merged.update(ids[sorted(ids, key=lambda x: int(x) if x.isdigit() else 0)[0]])
    return merged


def build_rows(case: Case, predicted: dict, measured: dict) -> list[Row]:
    return [Row(case.name, m, what, predicted[m][0], measured.get(m), target, predicted[m][1])
            for m, (what, target) in METRICS.items()]


def _device_header(ncu: str) -> dict:
    out = {}
    rc, text, _ = _run([ncu, "--version"], 60)
    if rc == 0:
        out["ncu"] = text.strip().splitlines()[-1] if text.strip() else "?"
    if shutil.which("nvidia-smi"):
        rc, text, _ = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 60)
        if rc == 0 and text.strip():
            out["device"] = text.strip().splitlines()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.simulator.validate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="markdown file to write (e.g. docs/IO_VALIDATION.md)")
    ap.add_argument("--cases", choices=tuple(CASES), default="full")
    ap.add_argument("--only", type=int, nargs="+", default=None, metavar="I", help="run only these case indices")
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="ncu executable (default: ncu or $NCU)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per ncu run")
    ap.add_argument("--l2-bytes", type=int, default=H100_L2_BYTES)
    ap.add_argument("--num-sms", type=int, default=H100_SMS)
    ap.add_argument("--raw-dir", default="out/ncu_raw", help="where raw ncu output and rows.json go (default: out/ncu_raw)")
    ap.add_argument("--from-raw", default=None, metavar="DIR", help="rebuild the table from kept ncu output")
    ap.add_argument("--dry-run", action="store_true", help="print predictions and ncu commands only")
    args = ap.parse_args(argv)

    cases = CASES[args.cases]
    if args.only:
        bad = [i for i in args.only if not 0 <= i < len(cases)]
        if bad:
            ap.error(f"--only {bad}: indices must be in 0..{len(cases) - 1}")
        cases = [cases[i] for i in args.only]
    out = Path(args.out)
    raw_dir = Path(args.raw_dir)
    header = {"date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python -m cuflash.simulator.validate"] + (argv if argv is not None else sys.argv[1:])),
              "L2 model": f"{args.l2_bytes / 2**20:.0f} MiB, {args.num_sms} SMs"}
    if args.dry_run:
        header["measurements"] = "pending: predictions only (--dry-run); run the script on the H100"
    if not (args.dry_run or args.from_raw):
        if shutil.which(args.ncu) is None:
            print(f"error: ncu not found ({args.ncu!r}); set --ncu or $NCU", file=sys.stderr)
            return 2
        header.update(_device_header(args.ncu))
    profiler = None if (args.dry_run or args.from_raw) else Profiler(args.ncu, raw_dir, args.timeout)

    rows, failures = [], {}
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case.name}", flush=True)
        predicted = predict(case, args.l2_bytes, args.num_sms)
        measured = {}
        if args.dry_run:
            print("  " + shlex.join(ncu_command(args.ncu, case, list(METRICS))[:-1]) + " '<driver>'")
        elif args.from_raw:
            measured = read_raw(Path(args.from_raw), case)
            if not measured:
                failures[case.name] = f"no ncu rows for this case in {args.from_raw}"
        else:
            try:
                measured, error = profiler.measure(case)
            except Exception as e:  # keep going: one config must not cost the whole run
                measured, error = {}, f"{type(e).__name__}: {e}"
            if not measured:
                failures[case.name] = error
                print(f"  no measurements: {error}", flush=True)
        case_rows = build_rows(case, predicted, measured)
        _print_table(case_rows)
        rows += case_rows
        out.parent.mkdir(parents=True, exist_ok=True)  # write after every case: a crash keeps the rest
        out.write_text(markdown(rows, header, profiler.dropped if profiler else {}, failures))
    raw_dir.mkdir(parents=True, exist_ok=True)
    with open(raw_dir / "rows.json", "w") as f:
        json.dump([r.__dict__ | {"error": r.error, "verdict": r.verdict} for r in rows], f, indent=1, default=str)
    print(f"wrote {out} ({len(rows)} rows) and {raw_dir / 'rows.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
