"""Context parallelism without a GPU: the sharding, the ring's step plans, the whole ring (forward and backward) run
by the one-process driver with float64 reference math against the unsharded float64 reference, the traffic counts
of the analyzer against the bytes the simulated ring passes, the launcher and the rendezvous."""
from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cuflash.distributed as cfd
from cuflash import reference
from cuflash.distributed import _group, _sharding
from cuflash.simulator import ring as ring_model


def global_visible(seqlen: int, causal: bool) -> np.ndarray:
    return np.tril(np.ones((seqlen, seqlen), bool)) if causal else np.ones((seqlen, seqlen), bool)


# --- sharding ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sharding", cfd.SHARDINGS)
def test_shards_cover_the_sequence_once_and_unshard_back(world_size, sharding):
    seqlen = 16 * world_size
    x = np.random.default_rng(world_size).standard_normal((2, seqlen, 3, 4))
    positions = [p for r in range(world_size) for part in cfd.rank_positions(r, world_size, seqlen, sharding)
                 for p in part]
    assert sorted(positions) == list(range(seqlen)), f"{sharding} P={world_size}: positions {positions}"
    parts = [cfd.shard_sequence(x, r, world_size, sharding=sharding) for r in range(world_size)]
    for r, part in enumerate(parts):
        rows = [p for rg in cfd.rank_positions(r, world_size, seqlen, sharding) for p in rg]
        assert np.array_equal(part, x[:, rows]), f"rank {r} holds the wrong rows"
    assert np.array_equal(cfd.unshard_sequence(parts, sharding=sharding), x)


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert [list(r) for r in cfd.rank_positions(1, 4, 16, "zigzag")] == [[2, 3], [12, 13]]
    assert [list(r) for r in cfd.rank_positions(1, 4, 16, "contiguous")] == [[4, 5, 6, 7]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sharding", cfd.SHARDINGS)
def test_step_plans_compute_every_visible_pair_exactly_once(world_size, causal, sharding):
    seqlen = 4 * world_size
    n = seqlen // world_size
    count = np.zeros((seqlen, seqlen), int)
    work = []
    for r in range(world_size):
        rows_r = np.array([p for rg in cfd.rank_positions(r, world_size, seqlen, sharding) for p in rg])
        pairs = 0
        for step in range(world_size):
            src = _sharding.step_source(r, step, world_size)
            rows_src = np.array([p for rg in cfd.rank_positions(src, world_size, seqlen, sharding) for p in rg])
            for b in _sharding.step_blocks(r, src, world_size, causal, sharding, n):
                qi, kj = rows_r[b.q_rows], rows_src[b.k_rows]
                block = np.tril(np.ones((len(qi), len(kj)), bool)) if b.causal else np.ones((len(qi), len(kj)), bool)
                # the block's own mask must be the global one on its rows: nothing visible left out or added
                assert np.array_equal(block, global_visible(seqlen, causal)[np.ix_(qi, kj)]) or not block.any() and \
                    not global_visible(seqlen, causal)[np.ix_(qi, kj)].any(), f"rank {r} step {step}: wrong mask"
                count[np.ix_(qi, kj)] += block
                pairs += int(block.sum())
        work.append(pairs)
    assert np.array_equal(count, global_visible(seqlen, causal).astype(int)), \
        f"P={world_size} causal={causal} {sharding}: pairs computed {count.tolist()}"
    if sharding == "zigzag" or not causal:
        assert len(set(work)) == 1, f"unbalanced work per rank: {work}"


def test_sharding_errors_name_the_value():
    with pytest.raises(ValueError, match=r"seqlen=10 must be a multiple of 4"):
        _sharding.local_length(10, 2, "zigzag")
    with pytest.raises(ValueError, match=r"sharding='striped' is not supported"):
        cfd.shard_sequence(np.zeros((1, 8, 1, 1)), 0, 2, sharding="striped")
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, 2\)"):
        cfd.shard_sequence(np.zeros((1, 8, 1, 1)), 2, 2)
    with pytest.raises(ValueError, match="parts is empty"):
        cfd.unshard_sequence([])


# --- the ring on the CPU: float64 reference math, one process ------------------------------------------------

CASES = list(itertools.product([1, 2, 3, 4], [False, True], cfd.SHARDINGS))


@pytest.mark.parametrize("world_size,causal,sharding", CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_simulated_ring_equals_unsharded_attention(world_size, causal, sharding, layout):
    rng = np.random.default_rng(hash((world_size, causal, sharding, layout)) % 2**32)
    b, h, h_kv, d = 2, 4, 2, 16  # grouped-query: two query heads per key/value head
    seqlen = 6 * world_size
    q, do = rng.standard_normal((b, seqlen, h, d)), rng.standard_normal((b, seqlen, h, d))
    k, v = rng.standard_normal((b, seqlen, h_kv, d)), rng.standard_normal((b, seqlen, h_kv, d))
    softcap = 4.0 if causal else None
    o_ref, lse_ref = reference.attention_forward64(q, k, v, causal, softcap=softcap)
    grads_ref = reference.attention_backward64(do, q, k, v, causal, softcap=softcap)
    t = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 2, 1, 3))
    kw = dict(causal=causal, sharding=sharding, layout=layout, softcap=softcap)
    o, lse = cfd.simulate_ring_attention_forward(t(q), t(k), t(v), world_size, **kw)
    what = f"P={world_size} causal={causal} {sharding} {layout}"
    assert np.abs(t(o) - o_ref).max() < 1e-12, f"o mismatch for {what}"
    assert np.abs(lse - lse_ref).max() < 1e-12, f"lse mismatch for {what}"
    grads = cfd.simulate_ring_attention_backward(t(do), t(q), t(k), t(v), o, lse, world_size, **kw)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert np.abs(t(g) - g_ref).max() < 1e-11, f"{name} mismatch for {what}"


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("world_size,causal", [(1, True), (2, True), (3, False), (4, True)])
def test_analyzer_counts_the_bytes_the_ring_passes(world_size, causal, backward):
    b, h, h_kv, d, seqlen = 1, 4, 2, 8, 8 * world_size
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((b, seqlen, hh, d)) for hh in (h, h_kv, h_kv))
    trace = []
    o, lse = cfd.simulate_ring_attention_forward(q, k, v, world_size, causal=causal,
                                                 trace=None if backward else trace)
    if backward:
        cfd.simulate_ring_attention_backward(rng.standard_normal(q.shape), q, k, v, o, lse, world_size,
                                             causal=causal, trace=trace)
    # NumPy runs move float64 arrays: 8-byte elements and 8-byte sums
    counts = ring_model.ring_counts(seqlen, world_size, batch=b, heads_q=h, heads_kv=h_kv, head_dim=d, causal=causal,
                                    elem_bytes=8, acc_bytes=8, backward=backward)
    assert counts.sent_bytes == trace, f"analyzer {counts.sent_bytes} != ring {trace}"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_analyzer_flops_split_the_unsharded_work_evenly(world_size, causal):
    seqlen, b, h, d = 64 * world_size, 2, 3, 32
    counts = ring_model.ring_counts(seqlen, world_size, batch=b, heads_q=h, head_dim=d, causal=causal)
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    assert sum(counts.flops_per_rank) == 4 * b * h * d * pairs
    assert len(set(counts.flops_per_rank)) == 1, f"zigzag ranks differ: {counts.flops_per_rank}"


def test_ring_is_bandwidth_bound_only_at_short_sequences():
    slow = 32e9  # PCIe 4.0 x16
    short = ring_model.ring_counts(8192, 2, heads_q=16, head_dim=128)
    long = ring_model.ring_counts(1 << 20, 2, heads_q=16, head_dim=128)
    assert ring_model.step_time_ratio(short, 450e12, slow) > 1 > ring_model.step_time_ratio(long, 450e12, slow)
    # the crossover of the docstring: n = (H_kv / H_q) e rate / bandwidth local rows
    n_cross = 2 * 450e12 / slow
    at = ring_model.ring_counts(int(2 * n_cross) // 4 * 4, 2, heads_q=16, head_dim=128)
    assert ring_model.step_time_ratio(at, 450e12, slow) == pytest.approx(1.0, rel=1e-3)


def test_simulation_input_errors():
    x = np.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"layout='sbhd' is not supported"):
        cfd.simulate_ring_attention_forward(x, x, x, 2, layout="sbhd")
    with pytest.raises(ValueError, match=r"seqlen=8 must be a multiple of 6"):
        cfd.simulate_ring_attention_forward(x, x, x, 3)
    with pytest.raises(ValueError, match=r"world_size=0 must be a positive integer"):
        cfd.simulate_ring_attention_forward(x, x, x, 0)
    with pytest.raises(ValueError, match=r"q has 8 positions and k 4"):
        cfd.simulate_ring_attention_forward(x, x[:, :4], x[:, :4], 2)


# --- launcher environment, rendezvous, launcher ----------------------------------------------------------------

def test_launch_env_from_torchrun_and_mpi_variables():
    env = cfd.launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                          "MASTER_PORT": "1234"})
    assert env == cfd.LaunchEnv(1, 2, 1, "10.0.0.1", 1234)
    env = cfd.launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "node0"})
    assert env == cfd.LaunchEnv(3, 4, 1, "node0", 29500)
    assert cfd.launch_env({"RANK": "0", "WORLD_SIZE": "1"}).master_addr == "127.0.0.1"


@pytest.mark.parametrize("environ,message", [
    ({}, "no launcher environment found"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, r"RANK=2 and WORLD_SIZE=2: need 0 <= rank < world size"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 must be"),
])
def test_launch_env_errors(environ, message):
    with pytest.raises(RuntimeError, match=message):
        cfd.launch_env(environ)


def test_rendezvous_hands_rank0s_id_to_every_rank():
    from cuflash.distributed.launch import free_port

    port, world = free_port(), 3
    uid = bytes(range(128))
    got = {}

    def join(rank):
        env = cfd.LaunchEnv(rank, world, rank, "127.0.0.1", port)
        got[rank] = _group.exchange_unique_id(env, lambda: uid if rank == 0 else pytest.fail("only rank 0 makes it"),
                                              timeout_s=30)

    threads = [threading.Thread(target=join, args=(r,)) for r in (2, 1, 0)]  # the others may come first
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: uid, 1: uid, 2: uid}


def test_launcher_sets_each_rank_and_stops_on_failure(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(r"""
        import os, sys
        line = " ".join(["rank", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"],
                         os.environ["MASTER_ADDR"], str(int(os.environ["MASTER_PORT"]) > 0)])
        os.write(1, (line + "\n").encode())  # one write: the ranks share the pipe, print() would interleave
        sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
    """))
    ok = subprocess.run([sys.executable, "-m", "cuflash.distributed.launch", "--nproc-per-node", "3", str(script), "0"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.split("\n")[:3]) == [f"rank {r} {r} 3 127.0.0.1 True" for r in range(3)], ok.stdout
    bad = subprocess.run([sys.executable, "-m", "cuflash.distributed.launch", "--nproc-per-node", "2", str(script), "3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3 and "rank 1 exited with 3" in bad.stderr, (bad.returncode, bad.stderr)


# --- packed (varlen) batches --------------------------------------------------------------------------------------

def random_cu(world_size: int, count: int, seed: int, zero_length: bool = True) -> np.ndarray:
    """Cumulative lengths of `count` sequences, each a multiple of 2 * world_size (one of length 0 when asked)."""
    lengths = np.random.default_rng(seed).integers(1, 5, count) * 2 * world_size
    if zero_length:
        lengths[count // 2] = 0
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("sharding", cfd.SHARDINGS)
def test_packed_shards_round_trip(world_size, sharding):
    cu = random_cu(world_size, 4, world_size)
    x = np.random.default_rng(3).standard_normal((int(cu[-1]), 2, 3))
    parts, local_cus = zip(*(cfd.shard_packed(x, cu, r, world_size, sharding=sharding) for r in range(world_size)))
    assert len(set(local_cus)) == 1 and list(np.diff(local_cus[0])) == [int(n) // world_size for n in np.diff(cu)]
    assert np.array_equal(cfd.unshard_packed(list(parts), cu, sharding=sharding), x)
    lse = np.random.default_rng(4).standard_normal((2, int(cu[-1])))  # (heads, total): rows on axis 1
    lse_parts = [cfd.shard_packed(lse, cu, r, world_size, sharding=sharding, axis=1)[0] for r in range(world_size)]
    assert np.array_equal(cfd.unshard_packed(lse_parts, cu, sharding=sharding, axis=1), lse)


@pytest.mark.parametrize("world_size,causal,sharding", CASES)
def test_simulated_varlen_ring_equals_unsharded_attention(world_size, causal, sharding):
    rng = np.random.default_rng(hash((world_size, causal, sharding)) % 2**32)
    cu = random_cu(world_size, 4, world_size + 10 * causal)
    total, h, h_kv, d = int(cu[-1]), 4, 2, 8
    q, do = rng.standard_normal((total, h, d)), rng.standard_normal((total, h, d))
    k, v = rng.standard_normal((total, h_kv, d)), rng.standard_normal((total, h_kv, d))
    softcap = 3.0 if causal else None
    o_ref, lse_ref = reference.attention_varlen_forward64(q, k, v, cu, cu, causal, softcap=softcap)
    grads_ref = reference.attention_varlen_backward64(do, q, k, v, cu, cu, causal, softcap=softcap)
    kw = dict(causal=causal, sharding=sharding, softcap=softcap)
    o, lse = cfd.simulate_ring_attention_varlen_forward(q, k, v, cu, world_size, **kw)
    what = f"varlen P={world_size} causal={causal} {sharding} lengths {np.diff(cu).tolist()}"
    assert np.abs(o - o_ref).max() < 1e-12, f"o mismatch for {what}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), f"lse -inf rows differ for {what}"
    assert np.abs(np.where(np.isfinite(lse_ref), lse - lse_ref, 0)).max() < 1e-12, f"lse mismatch for {what}"
    grads = cfd.simulate_ring_attention_varlen_backward(do, q, k, v, o, lse, cu, world_size, **kw)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert np.abs(g - g_ref).max() < 1e-11, f"{name} mismatch for {what}"


def test_varlen_simulation_input_errors():
    x = np.zeros((12, 2, 8))
    with pytest.raises(ValueError, match=r"the length of sequence 1=6 must be a multiple of 4"):
        cfd.simulate_ring_attention_varlen_forward(x, x, x, np.array([0, 4, 10, 12]), 2)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 8 but q has 12 rows"):
        cfd.simulate_ring_attention_varlen_forward(x, x, x, np.array([0, 4, 8]), 2)
    with pytest.raises(ValueError, match=r"must start at 0 and never decrease"):
        cfd.simulate_ring_attention_varlen_forward(x, x, x, np.array([0, 8, 4, 12]), 2)


# --- every rank agrees on the inputs before any transfer -----------------------------------------------------------

class FakeGroup:
    """A group whose all-gather returns this rank's values beside the given other ranks' rows."""

    def __init__(self, rank, others):
        self.rank, self.world_size, self.others, self.gathered = rank, len(others) + 1, others, []

    def all_gather_host(self, values):
        self.gathered.append(list(values))
        rows = list(self.others)
        rows.insert(self.rank, list(values))
        return np.array(rows, dtype=np.int64)


def _arrays(n=8):
    return tuple(np.zeros(s) for s in ((1, n, 2, 8), (1, n, 1, 8), (1, n, 1, 8)))


def test_agreed_setup_passes_when_every_rank_agrees():
    from cuflash.distributed import _agreed_setup, _signature
    arrays = _arrays()
    opt = cfd._ring.RingOptions(True, "zigzag", "bshd")
    group = FakeGroup(0, [_signature(False, arrays, ())])
    assert _agreed_setup(group, arrays, lambda: (opt, "ops")) == (opt, "ops")
    assert len(group.gathered) == 1


def test_a_rank_with_bad_input_raises_its_own_error_after_telling_the_others():
    from cuflash.distributed import _agreed_setup, _signature
    arrays = _arrays()
    group = FakeGroup(1, [_signature(False, arrays, ())])

    def bad():
        raise TypeError("k.dtype=float16 does not match q.dtype=bfloat16")

    with pytest.raises(TypeError, match="k.dtype=float16"):
        _agreed_setup(group, arrays, bad)
    assert group.gathered and group.gathered[0][0] == 1, "the rank must report its failure to the others first"


def test_the_other_ranks_raise_when_one_rejected_its_inputs():
    from cuflash.distributed import _agreed_setup, _signature
    arrays = _arrays()
    opt = cfd._ring.RingOptions(True, "zigzag", "bshd")
    group = FakeGroup(0, [_signature(True, arrays, ()), _signature(False, arrays, ())])
    with pytest.raises(ValueError, match=r"rank 1 of 3 rejected its inputs \(see its error\); this rank's were valid"):
        _agreed_setup(group, arrays, lambda: (opt, "ops"))


def test_ranks_with_different_shards_all_raise():
    from cuflash.distributed import _agreed_setup, _signature
    opt = cfd._ring.RingOptions(True, "zigzag", "bshd")
    group = FakeGroup(0, [_signature(False, _arrays(16), ())])
    with pytest.raises(ValueError, match=r"rank 0: q \(1, 8, 2, 8\) .*; rank 1: q \(1, 16, 2, 8\)"):
        _agreed_setup(group, _arrays(8), lambda: (opt, "ops"))
    packed = cfd._ring.RingOptions(True, "zigzag", "packed", (4, 6))
    group = FakeGroup(0, [_signature(False, _arrays(), (6, 4))])
    with pytest.raises(ValueError, match="other sequence lengths"):
        _agreed_setup(group, _arrays(), lambda: (packed, "ops"))
