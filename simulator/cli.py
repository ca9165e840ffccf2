"""cuflash-sim: count HBM/SRAM traffic, FLOPs and bank conflicts of attention tiling strategies.

  cuflash-sim sweep --strategy fa2 --strategy cuflash --seqlen 1024 4096 --head-dim 64 --batch 1 --heads 16 --json
  cuflash-sim sweep --strategy cuflash --kernels mma --seqlen 4096 --head-dim 128 --batch 1 --heads 16
  cuflash-sim sweep --strategy cuflash --seqlen 4096 16384 --head-dim 64 --batch 1 --heads 16 --causal --window 1024 0
  cuflash-sim sweep --strategy cuflash --dtype fp8 --seqlen 4096 16384 --head-dim 128 --batch 1 --heads 16 --causal
  cuflash-sim plot hbm-vs-n --out docs/img/hbm_vs_n.png
  cuflash-sim plot hbm-vs-n --causal --window 1024 0 --out docs/img/hbm_vs_n_window.png
  cuflash-sim plot hbm-vs-n --dtype fp16 fp32 --strategy fa2 --strategy cuflash --out hbm_vs_n_fp32.png
  cuflash-sim plot hbm-vs-n --dtype bf16 fp8 --head-dim 128 --strategy fa2 --strategy cuflash --out hbm_vs_n_fp8.png
  cuflash-sim plot block-size --out docs/img/block_size.png
  cuflash-sim ring --world-size 2 --seqlen 131072 1048576 --heads 16 --head-dim 128 --causal
  cuflash-sim plot ring --world-size 2 --out docs/img/ring_bandwidth.png
"""
from __future__ import annotations

import argparse
import json
import sys

from cuflash.config import KERNEL_FAMILIES

from .model import (
    DTYPE_BYTES,
    FP8_DTYPES,
    FP8_STRATEGIES,
    H100_HBM_BYTES_PER_S,
    H100_TENSOR_FLOPS,
    STRATEGIES,
    Problem,
)
from .ring import LINKS, plot_ring, ring_counts, ring_time, step_time_ratio
from .schedules import DEFAULT_KERNELS
from .strategies import simulate

SWEEP_FIELDS = ("strategy", "seqlen", "head_dim", "batch", "heads", "block_m", "block_n", "hbm_read_bytes",
                "hbm_write_bytes", "sram_read_bytes", "sram_write_bytes", "flops", "bank_conflicts")
DEFAULT_PLOT_SEQLENS = [2 ** i for i in range(8, 17)]  # 256 .. 65536
_STYLE = {"standard": ("o", "-"), "fa1": ("s", "-"), "fa2": ("^", "-"), "cuflash": ("x", "--")}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's message plus a pointer to the help, exit status 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _window_side(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"{value}: a window side must be >= 0, or -1 for unbounded")
    return value


def _bytes(text: str) -> int:
    """Integer bytes, with an optional KiB/MiB/GiB (or K/M/G, powers of 1024) suffix: 50MiB, 228K."""
    t = text.strip().upper().replace("_", "")
    for suffix, mult in (("GIB", 2 ** 30), ("MIB", 2 ** 20), ("KIB", 2 ** 10), ("G", 2 ** 30), ("M", 2 ** 20),
                         ("K", 2 ** 10), ("B", 1)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1
    try:
        value = int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (examples: 65536, 228K, 50MiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return value


def _add_problem_args(p: argparse.ArgumentParser, *, seqlen_default=None, head_dim=64, batch=None, heads=None,
                      several_dtypes=False):
    p.add_argument("--seqlen", type=_positive_int, nargs="+", default=seqlen_default, required=seqlen_default is None,
                   metavar="N", help="sequence lengths (seqlen_q; seqlen_k too unless --seqlen-k)")
    p.add_argument("--seqlen-k", type=_positive_int, default=None, metavar="NK", help="key length (default: = N)")
    p.add_argument("--head-dim", type=_positive_int, default=head_dim, required=head_dim is None, metavar="D")
    p.add_argument("--batch", type=_positive_int, default=batch, required=batch is None, metavar="B")
    p.add_argument("--heads", type=_positive_int, default=heads, required=heads is None, metavar="H")
    if several_dtypes:  # a list: one line per (strategy, dtype)
        p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), nargs="+", default=["fp16"], metavar="DTYPE",
                       help=f"element types, one line per strategy and dtype ({', '.join(DTYPE_BYTES)}; default fp16; "
                            f"fp8: cuflash's FP8 forward only)")
    else:
        p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp16",
                       help="element type (default fp16; fp8: e4m3 Q, K, V and a bf16 O, cuflash's FP8 forward only)")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p.add_argument("--window", type=_window_side, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="sliding window: query i sees key j iff i + diag - LEFT <= j <= i + diag + RIGHT "
                        "(diag = Sk - Sq; -1 = unbounded; with --causal the intersection)")
    p.add_argument("--no-causal-skip", action="store_true",
                   help="visit masked tiles too (no causal / window block skipping)")
    p.add_argument("--backward", action="store_true", help="count the backward pass instead of the forward")
    p.add_argument("--deterministic", action="store_true",
                   help="with --backward: cuflash's deterministic backward (bwd_sm90_ws_kernel: the dQ reductions "
                        "in a fixed order, with a turn counter per 64 rows; fp32 / tf32 / fp64 bwd_wide_kernel: its "
                        "dQ atomics in a fixed order, a turn counter per 16 rows; the other 16-bit main kernels: a "
                        "dQ kernel instead of fp32 atomics; the fp32 / tf32 Hopper backward at head dim 64 has no "
                        "atomics and counts as without it)")


def _add_kernels_arg(p: argparse.ArgumentParser):
    p.add_argument("--kernels", choices=KERNEL_FAMILIES, default=DEFAULT_KERNELS,
                   help="cuflash's kernel family on the H100: auto (default, what the library launches: the wgmma "
                        "kernels where the head dim has one) or mma (the mma.sync kernels, CUFLASH_KERNELS=mma)")


def _add_block_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("blocks (fa1, fa2; standard has none, cuflash reads cuflash.config)")
    g.add_argument("--block-m", type=_positive_int, default=None, metavar="BR", help="query block B_r")
    g.add_argument("--block-n", type=_positive_int, default=None, metavar="BC", help="key block B_c")
    g.add_argument("--sram-bytes", type=_bytes, default=None, metavar="M",
                   help="on-chip memory M; blocks B_c = ceil(M/4d), B_r = min(B_c, d) (M in elements)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cuflash-sim", description=__doc__.split("\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sw = sub.add_parser("sweep", help="counts per (strategy, N): a table, or JSON lines with --json")
    sw.add_argument("--strategy", choices=STRATEGIES, action="append", required=True,
                    help="repeat for several strategies")
    _add_problem_args(sw, head_dim=None, batch=None, heads=None)
    _add_block_args(sw)
    _add_kernels_arg(sw)
    sw.add_argument("--l2-bytes", type=_bytes, default=None, metavar="X",
                    help="add an LRU L2 of X bytes (e.g. 50MiB for an H100) and report dram_bytes")
    sw.add_argument("--num-sms", type=_positive_int, default=None, help="SMs for the L2 model's waves (default 132)")
    sw.add_argument("--json", action="store_true", help="one JSON record per line")

    pl = sub.add_parser("plot", help="figures: hbm-vs-n, block-size")
    psub = pl.add_subparsers(dest="figure", required=True, parser_class=_Parser)
    hv = psub.add_parser("hbm-vs-n", help="HBM traffic against N, log-log, one line per strategy (with --window: "
                                          "the windowed lines, and each flash strategy without the window, faint)")
    hv.add_argument("--out", required=True, metavar="FILE.png")
    hv.add_argument("--strategy", choices=STRATEGIES, action="append", default=None,
                    help="default: standard fa1 fa2 cuflash")
    _add_problem_args(hv, seqlen_default=DEFAULT_PLOT_SEQLENS, head_dim=64, batch=1, heads=1, several_dtypes=True)
    _add_block_args(hv)
    _add_kernels_arg(hv)
    rp = psub.add_parser("ring", help="ring attention: per-step transfer time / compute time against N, per link")
    rp.add_argument("--out", required=True, metavar="FILE.png")
    _add_ring_args(rp, [2 ** i for i in range(12, 21)])
    rg = sub.add_parser("ring", help="ring attention (cuflash.distributed): bytes sent and FLOPs per rank per step")
    _add_ring_args(rg, [131072, 262144, 524288, 1048576])
    rg.add_argument("--backward", action="store_true", help="the backward's exchanges and FLOPs")
    rg.add_argument("--link-gbps", type=float, default=None, metavar="GB/S",
                    help="link bandwidth per direction for the time model (default: each of PCIe 4, PCIe 5, NVLink 4)")
    bs = psub.add_parser("block-size", help="traffic and a runtime model against the block size (paper Fig. 2 middle)")
    bs.add_argument("--out", required=True, metavar="FILE.png")
    bs.add_argument("--blocks", type=_positive_int, nargs="+", default=[16, 32, 64, 128, 256, 512], metavar="BC")
    _add_problem_args(bs, seqlen_default=[1024], head_dim=64, batch=64, heads=16)
    return parser


def _problem(args, n: int, window=True, dtype: str | None = None) -> Problem:
    """The problem of the arguments at length n; window=False leaves --window out; dtype: one of a --dtype list."""
    w = tuple(args.window) if window and args.window is not None else None
    dtype = args.dtype if dtype is None else dtype
    return Problem(args.batch, args.heads, n, args.seqlen_k or n, args.head_dim, dtype, args.causal, w)


def _blocks_kw(args, strategy):
    if strategy in ("fa1", "fa2"):
        return dict(block_m=args.block_m, block_n=args.block_n, sram_bytes=args.sram_bytes)
    if strategy == "cuflash":
        return dict(deterministic=getattr(args, "deterministic", False),
                    kernels=getattr(args, "kernels", DEFAULT_KERNELS))
    return {}


def _progress(items, desc):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="run", file=sys.stderr, disable=None if len(items) > 4 else True, leave=False)


def _human(x: float | None, unit: str = "B") -> str:
    if x is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _run_sweep(args) -> list[dict]:
    jobs = [(s, n) for s in args.strategy for n in args.seqlen]
    records = []
    for strategy, n in _progress(jobs, "sweep"):
        c = simulate(strategy, _problem(args, n), backward=args.backward, causal_skip=not args.no_causal_skip,
                     l2_bytes=args.l2_bytes, num_sms=args.num_sms, **_blocks_kw(args, strategy))
        rec = {"strategy": strategy, "seqlen": n, "head_dim": args.head_dim, "batch": args.batch, "heads": args.heads,
               "block_m": c.block_m, "block_n": c.block_n, "hbm_read_bytes": c.hbm_read_bytes,
               "hbm_write_bytes": c.hbm_write_bytes, "sram_read_bytes": c.sram_read_bytes,
               "sram_write_bytes": c.sram_write_bytes, "flops": c.flops, "bank_conflicts": c.bank_conflicts}
        if args.l2_bytes is not None:
            rec["dram_bytes"] = c.dram_bytes
        records.append(rec)
    return records


def _print_table(records, with_dram):
    head = ["strategy", "N", "B_r", "B_c", "HBM read", "HBM write", "SRAM read", "SRAM write", "FLOPs", "conflicts"]
    if with_dram:
        head.append("DRAM (L2 model)")
    rows = []
    for r in records:
        row = [r["strategy"], str(r["seqlen"]), str(r["block_m"] or "-"), str(r["block_n"] or "-"),
               _human(r["hbm_read_bytes"]), _human(r["hbm_write_bytes"]), _human(r["sram_read_bytes"]),
               _human(r["sram_write_bytes"]), _human(r["flops"], "FLOP"),
               "-" if r["bank_conflicts"] is None else str(r["bank_conflicts"])]
        if with_dram:
            row.append(_human(r["dram_bytes"]))
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * w for w in widths]] + rows:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths))))


def _config_title(args, n=None) -> str:
    seq = f"N={n}, " if n else ""
    mask = "causal" if args.causal else "no mask"
    if args.window is not None:
        mask = f"{'causal, ' if args.causal else ''}window ({args.window[0]}, {args.window[1]})"
    direction = ("backward (deterministic)" if getattr(args, "deterministic", False) else "backward") \
        if args.backward else "forward"
    kernels = "" if getattr(args, "kernels", DEFAULT_KERNELS) == DEFAULT_KERNELS else ", cuflash: mma.sync kernels"
    dtype = args.dtype if isinstance(args.dtype, str) else "/".join(args.dtype)
    return (f"{direction}, {seq}d={args.head_dim}, batch={args.batch}, "
            f"heads={args.heads}, {dtype}, {mask}{kernels}")


def _add_ring_args(p: argparse.ArgumentParser, seqlens):
    p.add_argument("--world-size", type=_positive_int, default=2, metavar="P", help="GPUs in the ring (default 2)")
    p.add_argument("--seqlen", type=_positive_int, nargs="+", default=seqlens, metavar="N", help="global lengths")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--heads", type=_positive_int, default=16, help="query heads (default 16)")
    p.add_argument("--heads-kv", type=_positive_int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="(default: causal, zigzag)")
    p.add_argument("--tflops", type=float, default=450.0,
                   help="kernel rate for the time model, TFLOP/s (default 450: cuflash's bf16 D 128 causal fwd+bwd "
                        "on an H100 is of that order)")


def run_ring(args) -> None:
    links = {f"{args.link_gbps:g} GB/s": args.link_gbps * 1e9} if args.link_gbps else LINKS
    heads_kv = args.heads_kv or args.heads
    print(f"ring of {args.world_size}: B={args.batch} H_q={args.heads} H_kv={heads_kv} D={args.head_dim} "
          f"{'causal zigzag' if args.causal else 'not causal'}, bf16 K/V, float32 dK/dV sums, "
          f"{'backward' if args.backward else 'forward'}; kernels at {args.tflops:g} TFLOP/s")
    print(f"{'N':>9} {'exch':>4} {'bytes/exch':>10} {'GFLOP/rank':>10} " +
          " ".join(f"{'xfer/compute ' + name.split(' (')[0]:>24}" for name in links))
    for n in args.seqlen:
        c = ring_counts(n, args.world_size, batch=args.batch, heads_q=args.heads, heads_kv=heads_kv,
                        head_dim=args.head_dim, causal=args.causal, backward=args.backward)
        ratios = " ".join(f"{step_time_ratio(c, args.tflops * 1e12, bw):>12.3f} "
                          f"({ring_time(c, args.tflops * 1e12, bw) * 1e3:>8.1f} ms)" for bw in links.values())
        sent = c.sent_bytes
        print(f"{n:>9} {len(sent):>4} {_human(max(sent) if sent else 0):>10} "
              f"{max(c.flops_per_rank) / 1e9:>10.0f} {ratios}")


def plot_hbm_vs_n(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = args.strategy or ["standard", "fa1", "fa2", "cuflash"]
    dtypes = list(dict.fromkeys([args.dtype] if isinstance(args.dtype, str) else args.dtype))  # once each, in order
    ns = sorted(args.seqlen)
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    finals = {}

    def hbm(s, window, dtype):
        return [simulate(s, _problem(args, n, window, dtype), backward=args.backward,
                         causal_skip=not args.no_causal_skip, **_blocks_kw(args, s))
                for n in _progress(ns, f"{s} {dtype}")]

    for k, dtype in enumerate(dtypes):
        # one dtype: the labels of before; several: the dtype in every label, the later dtypes' lines dash-dotted
        tag = f" {dtype}" if len(dtypes) > 1 else ""
        # fp8 is cuflash's FP8 forward: the paper strategies get no fp8 line
        drawn = [s for s in strategies if dtype not in FP8_DTYPES or s in FP8_STRATEGIES]
        if not drawn:
            raise ValueError(f"--dtype {dtype} is counted for strategy {', '.join(FP8_STRATEGIES)} only (cuflash's "
                             f"FP8 forward): add --strategy cuflash")
        for s in drawn:
            cs = hbm(s, True, dtype)
            ys = [c.hbm_bytes for c in cs]
            blocks = "" if cs[-1].block_m is None else f" (B_r={cs[-1].block_m}, B_c={cs[-1].block_n})"
            marker, style = _STYLE.get(s, ("o", "-"))
            line, = ax.loglog(ns, ys, marker=marker, ls=style if k == 0 else "-.", ms=4, label=f"{s}{tag}{blocks}")
            finals[f"{s}{tag}"] = ys
            # a fixed window makes flash traffic linear in N: the same strategy without it, for contrast
            # (standard materializes all of S and P, window or not)
            if args.window is not None and s != "standard":
                full = [c.hbm_bytes for c in hbm(s, False, dtype)]
                ax.loglog(ns, full, marker=marker, ls=":", ms=3, color=line.get_color(), alpha=0.4,
                          label=f"{s}{tag}, no window")
                finals[f"{s}{tag} (no window)"] = full
    # theoretical slopes (Theorem 2): standard Theta(N d + N^2), flash Theta(N^2 d^2 / M); both reach
    # slope 2 for large N (flash with a d^2/M-times smaller constant), the N d terms give slope 1
    n0, n1 = ns[0], ns[-1]
    top = max(y[-1] for y in finals.values()) * 2
    bottom = min(y[0] for y in finals.values()) / 2
    ax.loglog([n0, n1], [top * (n0 / n1) ** 2, top], "k--", lw=0.8, alpha=0.6, label="slope 2: Θ(N²)")
    ax.loglog([n0, n1], [bottom, bottom * n1 / n0], "k:", lw=0.8, alpha=0.6, label="slope 1: Θ(N d)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("HBM traffic, reads + writes (bytes)")
    ax.set_title(f"Global-memory traffic vs N\n{_config_title(args)}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    plt.close(fig)


def plot_block_size(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = args.seqlen[0]
    p = _problem(args, n)
    blocks = sorted(args.blocks)
    series = {"fa1 (B_c, B_r = min(B_c, d))": [], "fa2 (B_r = B_c)": []}
    for b in _progress(blocks, "block-size"):
        series["fa1 (B_c, B_r = min(B_c, d))"].append(
            simulate("fa1", p, backward=args.backward, block_m=min(b, args.head_dim), block_n=b,
                     causal_skip=not args.no_causal_skip))
        series["fa2 (B_r = B_c)"].append(simulate("fa2", p, backward=args.backward, block_m=b, block_n=b,
                                                  causal_skip=not args.no_causal_skip))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for label, cs in series.items():
        ax1.plot(blocks, [c.hbm_bytes / 1e9 for c in cs], marker="o", label=label)
        # runtime model: the slower of moving the HBM bytes and doing the matmuls (H100 measured rates)
        t = [max(c.hbm_bytes / H100_HBM_BYTES_PER_S, c.flops_matmul / H100_TENSOR_FLOPS) * 1e3 for c in cs]
        ax2.plot(blocks, t, marker="o", label=label)
    flops_floor = series["fa2 (B_r = B_c)"][0].flops_matmul / H100_TENSOR_FLOPS * 1e3
    ax2.axhline(flops_floor, color="k", ls=":", lw=0.8, label="matmul time at 767 TFLOP/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size B_c (keys per tile)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("HBM traffic, reads + writes (GB)")
    ax2.set_ylabel("runtime model (ms): max(bytes / 3.0 TB/s, FLOPs / 767 TFLOP/s)")
    ax2.yaxis.label.set_size(8)
    fig.suptitle(f"Effect of block size (paper Fig. 2 middle): {_config_title(args, n)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "block_m", None) is not None and args.block_n is None or \
            getattr(args, "block_n", None) is not None and args.block_m is None:
        parser.error("--block-m and --block-n go together")
    if getattr(args, "sram_bytes", None) is not None and getattr(args, "block_m", None) is not None:
        parser.error("give either --block-m/--block-n or --sram-bytes, not both")
    if getattr(args, "deterministic", False) and not args.backward:
        parser.error("--deterministic selects cuflash's deterministic backward: add --backward")
    dtype = getattr(args, "dtype", ())  # one, a list (plot hbm-vs-n), or none (ring)
    fp8 = [dt for dt in ([dtype] if isinstance(dtype, str) else dtype) if dt in FP8_DTYPES]
    if fp8 and getattr(args, "backward", False):
        parser.error(f"--backward: cuflash has no FP8 backward; --dtype {fp8[0]} counts the FP8 forward "
                     f"(fwd_sm90_fp8_kernel) only")
    try:
        if args.command == "sweep":
            records = _run_sweep(args)
            if args.json:
                for rec in records:
                    print(json.dumps(rec))
            else:
                print(_config_title(args))
                _print_table(records, args.l2_bytes is not None)
        elif args.command == "ring":
            run_ring(args)
        elif args.figure == "ring":
            plot_ring(args.out, sorted(args.seqlen), args.world_size, batch=args.batch, heads_q=args.heads,
                      heads_kv=args.heads_kv or args.heads, head_dim=args.head_dim, causal=args.causal,
                      flops_per_s=args.tflops * 1e12)
            print(f"wrote {args.out}")
        elif args.figure == "hbm-vs-n":
            plot_hbm_vs_n(args)
            print(f"wrote {args.out}")
        else:
            plot_block_size(args)
            print(f"wrote {args.out}")
    except (ValueError, TypeError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"cuflash-sim: error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cuflash-sim: error: cannot write {getattr(args, 'out', '')}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
