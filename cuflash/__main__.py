"""`python -m cuflash` / `cuflash`: a demo on the GPU (the default), and the compile check.

    cuflash                       # = cuflash demo: attention on a realistic shape, checked and timed
    cuflash compile --arch sm_80  # compile every shipped kernel, print registers/spills/shared memory
    cuflash compile --all         # every architecture we ship for (sm_80 and sm_90a)
    cuflash compile --sass --filter fwd_sm90   # + SASS instruction counts (nvdisasm), some kernels only
    cuflash compile --every-mods --filter "BwdSm90WsTraits<64"   # every modifier set, not only the heaviest

The compile check needs NVRTC but no GPU, so CI runs it. It exits non-zero on a compile error, on any spill
(spill stores, spill loads or a stack frame) and on a ptxas advisory that it serialized warpgroup MMAs (flag
WGMMA-SERIALIZED-C75xx; its other wgmma advisories, such as an injected wgmma.wait_group, are printed beside the
row); with --sass also on local memory in the SASS and on a warpgroup MMA whose register A operand, loaded before a
loop, is overwritten inside it (a ptxas miscompilation).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
ALL_ARCHS = ("sm_80", "sm_90a")
SIM_EXAMPLE = ("cuflash-sim sweep --strategy standard --strategy fa2 --seqlen 1024 4096 --head-dim 64 "
               "--batch 1 --heads 16")


# --- demo -------------------------------------------------------------------------------------------

def _gpu_or_reason() -> str | None:
    """None when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); install cuflash with the extra for your CUDA: pip install '.[cuda13]'"
    try:
        if cupy.is_available():
            return None
    except Exception as e:  # a broken driver: say so instead of a traceback
        return f"cupy.is_available() raised {type(e).__name__}: {e}"
    return "no CUDA GPU found (cupy.is_available() is False)"


def demo(args) -> int:
    reason = _gpu_or_reason()
    if reason is not None:
        print(f"cuflash: {reason}, so the fused attention demo cannot run on this machine.")
        print("The IO analyzer needs no GPU: it counts the HBM/shared-memory traffic and FLOPs of standard")
        print("attention and of FlashAttention's tilings and plots them against the sequence length. Try:")
        print(f"    {SIM_EXAMPLE}")
        print("    cuflash-sim --help")
        print("On a machine with an NVIDIA GPU (sm_80 or newer), `python -m cuflash` runs, checks and times")
        print("attention; `python -m cuflash compile --all` checks every kernel without a GPU.")
        return 0

    import cupy as cp

    from . import _xpref, attention_forward

    batch, seqlen, heads, head_dim = args.batch, args.seqlen, args.heads, args.head_dim
    causal, dtype_name = not args.no_causal, args.dtype
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"cuflash demo on {name} (sm_{dev.compute_capability}): {dtype_name} q, k, v of shape "
          f"(batch={batch}, seqlen={seqlen}, heads={heads}, head_dim={head_dim}), causal={causal}")

    rng = cp.random.RandomState(0)
    q, k, v = (_xpref.to_lowp(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=cp.float32), dtype_name)
               for _ in range(3))

    t0 = time.perf_counter()
    try:
        o, lse = attention_forward(q, k, v, causal=causal)
    except (TypeError, ValueError) as e:  # e.g. --head-dim 12: the library's message says what is allowed
        print(f"cuflash demo: {e}", file=sys.stderr)
        return 2
    cp.cuda.get_current_stream().synchronize()
    print(f"first call (compiles the kernel through NVRTC, or loads it from the disk cache): "
          f"{time.perf_counter() - t0:.2f} s")

    # check two (batch, head) slices against float64 attention computed on the GPU, and against plain
    # attention in the input dtype (the pass rule of the tests: err <= 2 * plain err + 1e-5)
    ok = True
    for b, h in sorted({(0, 0), (batch - 1, heads - 1)}):
        qs, ks, vs = (_xpref.to_float32(x[b:b + 1, :, h:h + 1]) for x in (q, k, v))
        o64, lse64 = _xpref.attention_forward64(qs, ks, vs, causal)
        o_lowp = _xpref.attention_lowp(qs, ks, vs, dtype_name, causal)
        err = float(cp.abs(_xpref.to_float32(o[b:b + 1, :, h:h + 1]) - o64).max())
        bound = 2 * float(cp.abs(o_lowp - o64).max()) + 1e-5
        lse_err = float(cp.abs(lse[b:b + 1, h:h + 1] - lse64).max())
        ok &= err <= bound and lse_err <= 1e-3
        print(f"  batch {b}, head {h}: max|o - o_float64| = {err:.2e} (bound {bound:.2e}), "
              f"max|lse - lse_float64| = {lse_err:.2e}")
        del o64, lse64, o_lowp
    print(f"check against float64: {'PASS' if ok else 'FAIL'}")

    ms = time_ms(lambda: attention_forward(q, k, v, causal=causal), reps=args.reps)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    print(f"forward: {ms:.3f} ms (median of {args.reps}, CUDA events), {flops / ms / 1e9:.1f} TFLOP/s "
          f"(FLOPs = 4*B*H*S*S*D{' / 2 for causal' if causal else ''})")
    print("more: python -m cuflash.bench (against plain CuPy attention and torch SDPA), "
          "python -m pytest -m gpu (GPU tests)")
    return 0 if ok else 1


def time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `reps` runs, each timed with its own pair of CUDA events."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for start, stop in events:
        start.record(stream)
        fn()
        stop.record(stream)
    stop.synchronize()
    times = sorted(cp.cuda.get_elapsed_time(a, b) for a, b in events)
    return times[len(times) // 2]


# --- compile check ----------------------------------------------------------------------------------

def shipped_instantiations(arch: str = "sm_90a") -> list[tuple[str, object]]:
    """(kind, config) of every kernel the library can launch on `arch`: forward and backward."""
    from . import config

    out = [("fwd", cfg) for cfg in config.all_fwd_configs(arch)]
    out += [("bwd", cfg) for cfg in config.all_bwd_configs(arch)]
    return out


def every_mods_instantiations(arch: str = "sm_90a") -> list[tuple[str, object]]:
    """(kind, config) of the 16-bit forward and backward main kernels the registry picks on `arch` for every score
    modifier set (each combination of the MOD_* bits, and a BlockMask's tile map with or without a window, not
    deterministic), kernel head dim, dtype, causal flag and, for the backward, deterministic mode, with the
    deterministic dQ kernel where one runs after the main kernel; the forward's tiles for a key length not given
    (select's seqlen_k=None). These are the lighter sets that the shipped list (MODS_CHECKED: the heaviest set as
    the register bound of the others) does not build. Thousands of kernels: narrow it with --filter."""
    from . import config

    sets = list(range(config.MODS_ALL + 1)) + [config.MOD_BLOCKS, config.MOD_BLOCKS | config.MOD_WINDOW]
    out: dict[str, tuple[str, object]] = {}
    for hd in config.KERNEL_HEAD_DIMS:
        for dt in config.DTYPES:
            for causal in (False, True):
                for mods in sets:
                    if causal and mods & config.MOD_WINDOW:  # a window carries causal itself
                        continue
                    for op, kind, det in (("forward", "fwd", False), ("backward", "bwd", False),
                                          ("backward", "bwd", True)):
                        if det and mods & config.MOD_BLOCKS:  # the deterministic backward keeps the element
                            continue                              # mask (_families.blocks_only)
                        try:
                            cfg = config.select(op, hd, dt, causal, arch, mods=mods, deterministic=det)
                        except ValueError:  # no family takes this set
                            continue
                        out.setdefault(cfg.cpp_name(), (kind, cfg))
                        # (as _families._backward: deterministic and not ordered -> bwd_dq_kernel after it)
                        if det and not config.ordered_dq(cfg) and config.dq_supported(hd, mods, arch):
                            dq = config.dq_config(hd, dt, causal, mods)
                            out.setdefault(dq.cpp_name(), ("bwd", dq))
    return list(out.values())


SASS_OPS = ("HGMMA", "HMMA", "LDSM", "LDGSTS", "LDG", "STG", "REDG", "LDL", "STL")


def sass_text(cubin: bytes) -> str | None:
    """The SASS listing of a cubin from nvdisasm (from the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`), or
    None when nvdisasm is not found."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("nvdisasm")
    if exe is None:
        try:
            import nvidia.cu13  # the pip wheel puts nvdisasm in nvidia/cu13/bin

            cand = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "nvdisasm")
            exe = cand if os.path.isfile(cand) else None
        except ImportError:
            exe = None
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        # CuPy's getCUBIN drops the image's last byte (it treats it as a string terminator); the driver does
        # not mind, nvdisasm does: pad the ELF back to its size
        f.write(cubin + b"\0" * 8)
        f.flush()
        return subprocess.run([exe, "-c", f.name], capture_output=True, text=True).stdout


def sass_counts(cubin: bytes) -> dict | None:
    """Static counts of the SASS instructions of SASS_OPS in a cubin (`sass_text`); None when nvdisasm is not
    found. Tells, without a GPU, whether a kernel runs on wgmma (HGMMA) or mma.sync (HMMA), copies with cp.async
    (LDGSTS) and touches local memory (LDL/STL: spills or an array indexed at run time)."""
    text = sass_text(cubin)
    return None if text is None else sass_counts_of(text)


def sass_counts_of(text: str) -> dict:
    """sass_counts of a SASS listing."""
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]+)", text, re.M)
    return {op: sum(1 for o in ops if o == op) for op in SASS_OPS}


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9._]*)\s*([^;]*);", re.M)
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)


def _sass_writes(op: str, operands: str) -> range:
    """The general registers an instruction writes: its first operand, a register range for 64- / 128-bit results
    and for an HGMMA's accumulators (N / 2 of an m64nN fp32 product), nothing for stores, branches and barriers."""
    first = operands.split(",")[0].strip()
    m = re.fullmatch(r"R(\d+)", first)
    if m is None or op.startswith(("ST", "RED", "BRA", "BAR", "SYNCS", "WARPGROUP")):
        return range(0)
    base = int(m.group(1))
    if op.startswith("HGMMA"):
        n = re.match(r"HGMMA\.64x(\d+)x", op)
        return range(base, base + (int(n.group(1)) // 2 if n else 1))
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return range(base, base + width)


def sass_clobbered_a_operands(text: str) -> list[str]:
    """Loop-invariant wgmma A registers that the loop overwrites. A warpgroup MMA may take its A operand from registers
    (HGMMA Rd, Ra, gdesc): where Ra .. Ra + 3 are loaded from shared memory before the loop (Q's fragments, held for
    the whole key loop: the TF32 kernels' q_regs / a_regs) no instruction of the loop may write them. NVRTC 13.0's
    ptxas broke that in one kernel (the one-pass dQ kernel with 64-key tiles and Q in registers at 64 columns, refused
    by config): it reused those registers for temporaries and the next key tile's S took them as Q. Loops are read
    from the SASS listing's backward branches; one line per violation."""
    lines = []  # (kind, text): ("label", name) or ("op", opcode, operands)
    for raw in text.splitlines():
        lab = _SASS_LABEL.match(raw)
        if lab:
            lines.append(("label", lab.group(1)))
            continue
        m = _SASS_LINE.match(raw)
        if m:
            lines.append(("op", m.group(1), m.group(2)))
    where = {x[1]: i for i, x in enumerate(lines) if x[0] == "label"}
    loops = []
    for i, x in enumerate(lines):
        if x[0] == "op" and x[1].startswith("BRA"):
            t = re.search(r"\((\.L_x_\d+)\)", x[2])
            if t and t.group(1) in where and where[t.group(1)] < i:
                loops.append((where[t.group(1)], i))
    writes = [(_sass_writes(x[1], x[2]) if x[0] == "op" else range(0)) for x in lines]
    out = []
    for h, x in enumerate(lines):
        m = re.match(r"R\d+\s*,\s*R(\d+)\s*,\s*gdesc", x[2]) if x[0] == "op" and x[1].startswith("HGMMA") else None
        if m is None:
            continue
        for lo, hi in loops:
            if not lo < h < hi:
                continue
            for r in range(int(m.group(1)), int(m.group(1)) + 4):
                before = [i for i in range(lo) if r in writes[i]]
                if not before or not lines[before[-1]][1].startswith("LDS"):
                    continue  # not loaded from shared memory before the loop
                if any(r in writes[i] for i in range(lo, h)):
                    continue  # redefined in the loop ahead of the MMA (P, dS of this step)
                inside = [i for i in range(h, hi + 1) if r in writes[i]]
                if inside:
                    out.append(f"R{r}, an A operand of {x[1]} loaded before the loop, is written in the loop by "
                               f"{lines[inside[0]][1]} {lines[inside[0]][2].strip()}")
    return sorted(set(out))


def compile_check(args) -> int:
    from . import _compile, config

    archs = ALL_ARCHS if args.all else (args.arch,)
    try:
        nvrtc = _compile._nvrtc()
        version = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:
        print(f"cuflash compile: NVRTC is not usable: {type(e).__name__}: {e}\n"
              f"install it with: pip install nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 2
    listing = every_mods_instantiations if args.every_mods else shipped_instantiations
    jobs = [(arch, kind, cfg) for arch in archs for kind, cfg in listing(arch) if args.filter in cfg.cpp_name()]
    print(f"compiling {len(jobs)} kernel instantiations for {', '.join(archs)} with NVRTC {version}, "
          f"{args.jobs} threads, sources {_compile.cuda_dir()}")

    def build(job):
        arch, kind, cfg = job
        t0 = time.perf_counter()
        try:
            return job, _compile.compile_kernel(cfg.cpp_name(), arch, use_cache=False), None, time.perf_counter() - t0
        except Exception as e:  # report every failing kernel, not only the first
            return job, None, e, time.perf_counter() - t0

    t_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(build, jobs))

    header = f"{'arch':<7} {'kind':<4} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem KiB':>8} {'time':>6}  kernel"
    print(header)
    print("-" * len(header))
    problems = []
    for (arch, kind, cfg), compiled, error, seconds in results:
        name = cfg.cpp_name()
        if error is not None:
            print(f"{arch:<7} {kind:<4} {'-':>4} {'-':>11} {'-':>5} {'-':>8} {seconds:5.1f}s  {name}  COMPILE ERROR")
            problems.append(f"{arch} {name}: compile error: {str(error).strip().splitlines()[0]}")
            continue
        res = compiled.resources
        smem = res["static_smem"] + int(getattr(cfg, "smem_bytes", 0))
        regs = res["registers"] if res["registers"] is not None else "?"
        flags = []
        if res["spill_stores"] or res["spill_loads"]:
            flags.append("SPILL")
        if res["stack"]:
            flags.append("STACK")
        if res["registers"] is None:
            flags.append("NO-PTXAS-INFO")
        if res["wgmma_serialized"]:
            flags.append("WGMMA-SERIALIZED-" + "-".join(res["wgmma_serialized"]))
        notes = [c for c in res["wgmma_advisories"] if c not in res["wgmma_serialized"]]  # e.g. an injected wait
        if smem > config.smem_limit(arch):
            flags.append("SMEM")
        sass = ""
        if args.sass:
            text = sass_text(compiled.cubin)
            counts = None if text is None else sass_counts_of(text)
            if counts is None:
                print("cuflash compile --sass: nvdisasm not found (install the CUDA toolkit, or "
                      "pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
                return 2
            sass = "  " + " ".join(f"{op}={n}" for op, n in counts.items() if n)
            if counts["LDL"] or counts["STL"]:
                flags.append("LOCAL-MEMORY")
            if sass_clobbered_a_operands(text):
                flags.append("A-REGISTERS-CLOBBERED")
        note = f"  (ptxas {' '.join(notes)})" if notes else ""
        print(f"{arch:<7} {kind:<4} {regs:>4} {res['spill_stores']:>5}/{res['spill_loads']:<5} {res['stack']:>5} "
              f"{smem / 1024:8.1f} {seconds:5.1f}s  {name}{'  ' + ' '.join(flags) if flags else ''}{note}{sass}")
        if flags:
            problems.append(f"{arch} {name}: {' '.join(flags)} (spill stores {res['spill_stores']} B, "
                            f"spill loads {res['spill_loads']} B, stack {res['stack']} B, registers {regs}, "
                            f"shared memory {smem} B of {config.smem_limit(arch)})")
    print(f"{len(results)} kernels in {time.perf_counter() - t_start:.1f} s; {len(problems)} with problems")
    for p in problems:
        print(f"  PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


# --- command line -----------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _demo_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The demo's options, on the main parser (with defaults) and on `demo` (without: a subparser's
    defaults would overwrite values given before the subcommand)."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=d("bf16"), help="input dtype (default bf16)")
    p.add_argument("--batch", type=_positive_int, default=d(4), help="default 4")
    p.add_argument("--seqlen", type=_positive_int, default=d(4096), help="default 4096")
    p.add_argument("--heads", type=_positive_int, default=d(16), help="default 16")
    p.add_argument("--head-dim", type=_positive_int, default=d(128), help="default 128 (a multiple of 8, <= 256)")
    p.add_argument("--no-causal", action="store_true", default=d(False), help="full (non-causal) attention")
    p.add_argument("--reps", type=_positive_int, default=d(20), help="timed repetitions (median reported)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuflash", description="FlashAttention for CuPy. Without a subcommand: the demo.",
        epilog="The IO analyzer (no GPU needed) is a separate command: cuflash-sim --help")
    _demo_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="{demo,compile}")
    p_demo = sub.add_parser("demo", help="run attention on a realistic shape, check it against float64, time it")
    _demo_options(p_demo, defaults=False)
    p_compile = sub.add_parser("compile", help="compile every shipped kernel (no GPU needed); fail on any spill or tile over the target's shared memory")
    p_compile.add_argument("--arch", choices=ARCHS, default="sm_90a", help="target architecture (default sm_90a)")
    p_compile.add_argument("--all", action="store_true", help=f"every architecture we ship for: {', '.join(ALL_ARCHS)}")
    p_compile.add_argument("--sass", action="store_true",
                           help="also count SASS instructions (HGMMA, HMMA, LDGSTS, LDL/STL, ...) with nvdisasm, and "
                                "fail a kernel that touches local memory or overwrites a loop-invariant wgmma A "
                                "register (sass_clobbered_a_operands)")
    p_compile.add_argument("--filter", default="", metavar="TEXT",
                           help="only kernels whose C++ name contains TEXT (e.g. fwd_sm90)")
    p_compile.add_argument("--every-mods", action="store_true",
                           help="the main kernels of every score-modifier set the library can launch (not only the "
                                "heaviest, which the default list builds as the register bound of the others); "
                                "thousands of kernels: combine with --filter")
    p_compile.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                           help="compiler threads (default: the number of CPUs)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compile":
        return compile_check(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
