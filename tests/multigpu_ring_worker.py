"""One rank of tests/test_multigpu_ring.py, started by `python -m cuflash.distributed.launch`: ring attention over
the GPUs of the job against (a) the unsharded problem in float64 by the pass rule and (b) the one-process
simulation of the same ring on this GPU, bit for bit (forward, and the backward with deterministic=True). Writes
rank<R>.json with one record per case into the directory given as the first argument."""
from __future__ import annotations

import json
import os
import sys
import traceback

import cupy as cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cuflash.distributed as cfd  # noqa: E402
from cuflash import _xpref  # noqa: E402
from gpu_helpers import max_abs, randn, same_bits, seed_of  # noqa: E402

CASES = [  # causal, sharding, layout, dtype, head dim, (H_q, H_kv), chunk length
    (True, "zigzag", "bshd", "bf16", 128, (4, 4), 256),
    (False, "zigzag", "bhsd", "fp16", 64, (4, 2), 200),
    (True, "contiguous", "bshd", "bf16", 64, (4, 4), 128),
]


def rule(got, ref64, lowp, factor):
    err, bound = max_abs(got - ref64), factor * max_abs(lowp - ref64) + 1e-5
    return {"err": err, "bound": bound, "finite": bool(cp.isfinite(got).all())}


def run_case(group, causal, sharding, layout, dtype, d, heads, chunk):
    p, r = group.world_size, group.rank
    b, (h, h_kv) = 2, heads
    n = 2 * p * chunk
    seed = seed_of("multigpu", causal, sharding, layout, dtype, d, heads, chunk)
    full = [randn(s, dtype, seed + i) for i, s in enumerate(((b, n, h, d), (b, n, h_kv, d), (b, n, h_kv, d),
                                                              (b, n, h, d)))]  # same values on every rank
    f32 = [_xpref.to_float32(x) for x in full]
    bits = cp.uint16
    laid = [x if layout == "bshd" else cp.ascontiguousarray(x.view(bits).transpose(0, 2, 1, 3)).view(x.dtype)
            for x in full]
    ax = 1 if layout == "bshd" else 2
    q, k, v, do = (cfd.shard_sequence(x, r, p, axis=ax, sharding=sharding) for x in laid)
    kw = dict(causal=causal, sharding=sharding, layout=layout)
    o, lse = cfd.ring_attention_forward(q, k, v, group, **kw)
    grads_det = cfd.ring_attention_backward(do, q, k, v, o, lse, group, deterministic=True, **kw)
    grads = cfd.ring_attention_backward(do, q, k, v, o, lse, group, **kw)
    # the same ring simulated in this process, this rank's rows
    o_sim, lse_sim = cfd.simulate_ring_attention_forward(*laid[:3], p, **kw)
    g_sim = cfd.simulate_ring_attention_backward(laid[3], *laid[:3], o_sim, lse_sim, p, deterministic=True, **kw)
    mine = lambda x, axis=ax: cfd.shard_sequence(x, r, p, axis=axis, sharding=sharding)  # noqa: E731
    bshd = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 2, 1, 3))
    # float64 and low-precision references of the unsharded problem, this rank's rows (bshd order)
    o64, lse64 = _xpref.attention_forward64(*f32[:3], causal)
    o_lowp = _xpref.attention_lowp(*f32[:3], dtype, causal)
    g64 = _xpref.attention_backward64(f32[3], *f32[:3], causal)
    g_lowp = _xpref.attention_backward_lowp(f32[3], *f32[:3], dtype, causal)
    rec = {"case": f"P={p} causal={causal} {sharding} {layout} {dtype} D={d} H={h}/{h_kv} N={n}", "rank": r,
           "o": rule(bshd(_xpref.to_float32(o)), mine(o64, 1), mine(o_lowp, 1), 2.0),
           "lse_err": max_abs(lse - mine(lse64, 2)),
           "o_bitwise_sim": same_bits(o, mine(o_sim)), "lse_bitwise_sim": same_bits(lse, mine(lse_sim, 2))}
    for name, g, gd, gs, ref, lowp in zip(("dq", "dk", "dv"), grads, grads_det, g_sim, g64, g_lowp):
        rec[name] = rule(bshd(_xpref.to_float32(g)), mine(ref, 1), mine(lowp, 1), 3.0)
        rec[name + "_det"] = rule(bshd(_xpref.to_float32(gd)), mine(ref, 1), mine(lowp, 1), 3.0)
        rec[name + "_det_bitwise_sim"] = same_bits(gd, mine(gs))
    return rec


def run_varlen_case(group, causal, dtype, d, heads, chunks):
    """A packed batch, every sequence zigzag-sharded over the ranks."""
    p, r = group.world_size, group.rank
    h, h_kv = heads
    cu_host = [0]
    for c in chunks:
        cu_host.append(cu_host[-1] + 2 * p * c)
    total = cu_host[-1]
    cu = cp.asarray(cu_host, dtype=cp.int32)
    seed = seed_of("multigpu-varlen", causal, dtype, d, heads, chunks)
    full = [randn((total, hh, d), dtype, seed + i) for i, hh in enumerate((h, h_kv, h_kv, h))]
    f32 = [_xpref.to_float32(x) for x in full]
    (q, k, v, do), local_cu = zip(*(cfd.shard_packed(x, cu_host, r, p) for x in full))
    local_cu = cp.asarray(local_cu[0], dtype=cp.int32)
    o, lse = cfd.ring_attention_varlen_forward(q, k, v, local_cu, group, causal=causal)
    grads_det = cfd.ring_attention_varlen_backward(do, q, k, v, o, lse, local_cu, group, causal=causal,
                                                   deterministic=True)
    grads = cfd.ring_attention_varlen_backward(do, q, k, v, o, lse, local_cu, group, causal=causal)
    o_sim, lse_sim = cfd.simulate_ring_attention_varlen_forward(*full[:3], cu, p, causal=causal)
    g_sim = cfd.simulate_ring_attention_varlen_backward(full[3], *full[:3], o_sim, lse_sim, cu, p, causal=causal,
                                                        deterministic=True)
    mine = lambda x, axis=0: cfd.shard_packed(x, cu_host, r, p, axis=axis)[0]  # noqa: E731
    o64, lse64 = _xpref.attention_varlen_forward64(*f32[:3], cu, cu, causal)
    o_lowp = _xpref.attention_varlen_lowp(*f32[:3], cu, cu, dtype, causal)
    g64 = _xpref.attention_varlen_backward64(f32[3], *f32[:3], cu, cu, causal)
    g_lowp = _xpref.attention_varlen_backward_lowp(f32[3], *f32[:3], cu, cu, dtype, causal)
    rec = {"case": f"P={p} varlen causal={causal} {dtype} D={d} H={h}/{h_kv} lengths={list(cu_host)}", "rank": r,
           "o": rule(_xpref.to_float32(o), mine(o64), mine(o_lowp), 2.0), "lse_err": max_abs(lse - mine(lse64, 1)),
           "o_bitwise_sim": same_bits(o, mine(o_sim)), "lse_bitwise_sim": same_bits(lse, mine(lse_sim, 1))}
    for name, g, gd, gs, ref, lowp in zip(("dq", "dk", "dv"), grads, grads_det, g_sim, g64, g_lowp):
        rec[name] = rule(_xpref.to_float32(g), mine(ref), mine(lowp), 3.0)
        rec[name + "_det"] = rule(_xpref.to_float32(gd), mine(ref), mine(lowp), 3.0)
        rec[name + "_det_bitwise_sim"] = same_bits(gd, mine(gs))
    return rec


VARLEN_CASES = [(True, "bf16", 128, (4, 2), (37, 2, 0, 96))]


def run_bad_input_cases(group):
    """Rank 1 passes a k of another dtype, then shards of another length (valid on their own): every rank must
    raise before any transfer, and the group must still work afterwards (checked by the barrier after)."""
    r = group.rank
    q = randn((1, 256, 2, 64), "bf16", 1 + r)
    rec = {"case": "bad input", "rank": r}
    k_bad = randn((1, 256, 2, 64), "fp16" if r == 1 else "bf16", 2)
    short = q[:, :128] if r == 1 else q
    for name, (qq, kk) in (("dtype", (q, k_bad)), ("length", (short, short))):
        try:
            cfd.ring_attention_forward(qq, kk, kk, group, causal=True)
            rec[name] = "no error"
        except (TypeError, ValueError) as e:
            rec[name] = f"{type(e).__name__}: {e}"
    group.barrier()
    return rec


def main(out_dir: str) -> int:
    group = cfd.init_process_group()
    records = []
    for run, case in [(run_case, c) for c in CASES] + [(run_varlen_case, c) for c in VARLEN_CASES]:
        try:
            records.append(run(group, *case))
        except Exception:  # noqa: BLE001 - recorded for the test to report; the other rank may hang otherwise
            records.append({"case": repr(case), "rank": group.rank, "error": traceback.format_exc()})
            break
    if not any("error" in rec for rec in records):
        records.append(run_bad_input_cases(group))
    with open(os.path.join(out_dir, f"rank{group.rank}.json"), "w") as f:
        json.dump(records, f, indent=1)
    group.barrier()
    group.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
