"""Ring attention (cuflash.distributed): bytes each rank sends and FLOPs it computes per ring step, and when the
ring is bandwidth-bound.

The counts walk the library's own step plans (cuflash.distributed._sharding.step_blocks) and exchange pattern
(_ring.forward_rank / backward_rank), so they are the algorithm's, not a formula beside it; tests check them
against the bytes a simulated ring actually passes.

Per rank of P, with n = N / P local rows, B batch, H_q / H_kv heads, D head dim, e bytes per element, a bytes per
float32 (float64) sum:
  forward   exchanges 0 .. P-2: K and V shards, 2 B n H_kv D e bytes
  backward  exchange s (0 .. P-1): K and V while s < P-1, plus the dK/dV sums of the block held at s-1 when s > 0
            (2 B n H_kv D a); a last exchange sends the sums home: P + 1 exchanges in all
  FLOPs     per Block of a step: 4 B H_q D x (visible (query, key) pairs), backward 2.5 x that (as the benchmark
            counts); a causal diagonal block of n rows has n (n + 1) / 2 visible pairs
A step overlaps its transfer with its kernels, so it takes max(compute, transfer): the ring is bandwidth-bound
where bytes / link bandwidth > FLOPs / kernel rate. Zigzag causal steps after the first carry half a block of work
(2 B H_q n^2 D forward) against the full K/V shard, so the crossover is n = 2 (H_kv / H_q) (e / 2) rate / bandwidth
for the forward. The backward's middle steps (P >= 3) carry K/V and the sums: 3x the bytes (16-bit inputs, float32
sums) for 2.5x the FLOPs, a 1.2x higher ratio; with P = 2 each exchange carries one or the other (0.8x).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cuflash.distributed import _sharding

BWD_FLOP_FACTOR = 2.5


@dataclass
class RingStep:
    step: int
    sent_bytes: int  # bytes each rank sends at the exchange started in this step
    flops: list = field(default_factory=list)  # per rank


@dataclass
class RingCounts:
    seqlen: int
    world_size: int
    backward: bool
    steps: list  # RingStep; the backward's last entry is the homecoming exchange (no FLOPs)

    @property
    def sent_bytes(self) -> list[int]:
        return [s.sent_bytes for s in self.steps if s.sent_bytes]

    @property
    def flops_per_rank(self) -> list[float]:
        return [sum(s.flops[r] for s in self.steps if s.flops) for r in range(self.world_size)]


def _visible_pairs(rows_q: int, rows_k: int, causal: bool) -> int:
    if not causal:
        return rows_q * rows_k
    if rows_q != rows_k:  # the plans only make square causal blocks (a rank's own shard)
        raise ValueError(f"causal block {rows_q} x {rows_k}: expected square")
    return rows_q * (rows_q + 1) // 2


def ring_counts(seqlen: int, world_size: int, *, batch: int = 1, heads_q: int = 16, heads_kv: int | None = None,
                head_dim: int = 128, causal: bool = True, sharding: str = "zigzag", elem_bytes: int = 2,
                acc_bytes: int = 4, backward: bool = False) -> RingCounts:
    """Bytes sent and FLOPs per rank for each ring step (module docstring)."""
    heads_kv = heads_q if heads_kv is None else heads_kv
    n = _sharding.local_length(seqlen, world_size, _sharding.check_sharding(sharding))
    kv_bytes = 2 * batch * n * heads_kv * head_dim * elem_bytes
    sums_bytes = 2 * batch * n * heads_kv * head_dim * acc_bytes
    factor = BWD_FLOP_FACTOR if backward else 1.0
    steps = []
    for s in range(world_size):
        flops = []
        for r in range(world_size):
            src = _sharding.step_source(r, s, world_size)
            pairs = sum(_visible_pairs(b.q_rows.stop - b.q_rows.start, b.k_rows.stop - b.k_rows.start, b.causal)
                        for b in _sharding.step_blocks(r, src, world_size, causal, sharding, n))
            flops.append(factor * 4.0 * batch * heads_q * head_dim * pairs)
        sent = (kv_bytes if s + 1 < world_size else 0) + (sums_bytes if backward and s > 0 else 0)
        steps.append(RingStep(s, sent, flops))
    if backward and world_size > 1:
        steps.append(RingStep(world_size, sums_bytes, []))
    return RingCounts(seqlen, world_size, backward, steps)


def step_time_ratio(counts: RingCounts, flops_per_s: float, link_bytes_per_s: float) -> float:
    """The largest (transfer time / compute time) over the steps whose transfer overlaps compute: above 1 the ring
    waits for the link."""
    ratios = []
    for s in counts.steps:
        if s.flops and s.sent_bytes:
            ratios.append((s.sent_bytes / link_bytes_per_s) / (max(s.flops) / flops_per_s))
    return max(ratios) if ratios else 0.0


def ring_time(counts: RingCounts, flops_per_s: float, link_bytes_per_s: float) -> float:
    """Modelled seconds: each step the slower of its kernels and its transfer, the homecoming transfer after."""
    t = 0.0
    for s in counts.steps:
        compute = max(s.flops) / flops_per_s if s.flops else 0.0
        t += max(compute, s.sent_bytes / link_bytes_per_s)
    return t


# Link bandwidths per direction (bytes/s) for the plot: PCIe 4.0 / 5.0 x16 (nominal), NVLink 4 of an H100 SXM
# (450 GB/s per direction nominal).
LINKS = {"PCIe 4.0 x16 (32 GB/s)": 32e9, "PCIe 5.0 x16 (64 GB/s)": 64e9, "NVLink 4 (450 GB/s)": 450e9}


def plot_ring(out: str, seqlens, world_size: int, *, batch: int, heads_q: int, heads_kv: int, head_dim: int,
              causal: bool, flops_per_s: float, links=None) -> None:
    """Transfer time / compute time per ring step against N, one line per link and pass (forward, backward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = LINKS if links is None else links
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for (name, bw), color in zip(links.items(), ("tab:red", "tab:orange", "tab:blue", "tab:green")):
        for backward, style in ((False, "-"), (True, "--")):
            ys = [step_time_ratio(ring_counts(n, world_size, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                                              head_dim=head_dim, causal=causal, backward=backward), flops_per_s, bw)
                  for n in seqlens]
            ax.loglog(seqlens, ys, style, marker="o", ms=3, color=color,
                      label=f"{name}, {'backward' if backward else 'forward'}")
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="transfer = compute: above, the ring waits for the link")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence length N (tokens)")
    ax.set_ylabel("per-step transfer time / compute time")
    ax.set_title(f"Ring attention over {world_size} GPUs: when is it bandwidth-bound?\nB={batch}, H_q={heads_q}, "
                 f"H_kv={heads_kv}, D={head_dim}, {'causal zigzag' if causal else 'not causal'}, bf16, kernels at "
                 f"{flops_per_s / 1e12:.0f} TFLOP/s", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
