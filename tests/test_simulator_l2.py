"""The LRU L2 model: the cache itself on hand-made traces, and the DRAM predictions at the limits."""
import numpy as np
import pytest

from cuflash.simulator import Problem, simulate
from cuflash.simulator.l2 import _lru, simulate_l2


def _run(trace, capacity, weights=None):
    units = np.array([u for u, _ in trace], np.int64)
    writes = np.array([w for _, w in trace], np.bool_)
    weights = np.ones(units.max() + 1, np.int64) if weights is None else np.asarray(weights, np.int64)
    return tuple(int(x) for x in _lru(units, writes, weights, capacity))


def test_lru_evicts_the_least_recently_used():
    # capacity 2: A B A C -> C evicts B (A was used after B); B misses again
    assert _run([(0, 0), (1, 0), (0, 0), (2, 0), (1, 0)], 2) == (4, 0, 0)
    # and A stayed: one more A is a hit
    assert _run([(0, 0), (1, 0), (0, 0), (2, 0), (0, 0)], 2) == (3, 0, 0)


def test_writes_allocate_without_reading_and_are_written_back():
    # write A, read B, read C: A (dirty) is evicted -> one write-back; B, C left clean
    assert _run([(0, 1), (1, 0), (2, 0)], 2) == (2, 1, 0)
    # a write that stays resident is flushed at the end
    assert _run([(0, 1), (1, 0)], 2) == (1, 0, 1)


def test_weights_count_sectors():
    # A weighs 3 sectors, B 2: with room for 4 sectors B evicts A
    assert _run([(0, 0), (1, 0), (0, 0)], 4, weights=[3, 2]) == (8, 0, 0)


@pytest.mark.parametrize("strategy", ["fa1", "fa2", "cuflash"])
@pytest.mark.parametrize("causal", [False, True])
def test_an_l2_that_holds_everything_reads_each_input_once(strategy, causal):
    p = Problem(2, 4, 640, 768, 64, "fp16", causal)
    r = simulate_l2(strategy, p, l2_bytes=1 << 30)
    compulsory = 2 * 4 * (640 + 2 * 768) * 64 * 2
    if strategy == "fa1":
        assert r.read_bytes == compulsory, "O, l, m are written (memset) before they are read"
    else:
        assert r.read_bytes <= compulsory, f"{strategy}: {r.read_bytes} > compulsory {compulsory}"
        assert r.read_bytes >= compulsory - 2 * 4 * 640 * 64 * 2 * (1 if causal else 0)


@pytest.mark.parametrize("strategy,kw", [("fa2", {}), ("cuflash", {}), ("cuflash", {"kernels": "mma"})])
def test_an_l2_smaller_than_a_tile_misses_every_access(strategy, kw):
    p = Problem(1, 4, 512, 512, 64, "fp16", True)
    r = simulate_l2(strategy, p, l2_bytes=32, **kw)
    assert r.read_bytes == simulate(strategy, p, **kw).hbm_read_bytes


@pytest.mark.parametrize("strategy", ["fa1", "fa2", "cuflash"])
@pytest.mark.parametrize("backward", [False, True])
def test_tile_granularity_agrees_with_row_granularity(strategy, backward):
    """The documented approximation: LRU over whole tiles vs over every row (sector runs)."""
    p = Problem(1, 4, 1500, 1300, 64, "fp16", True)
    for l2 in (192 * 1024, 1 << 20):
        a = simulate_l2(strategy, p, l2_bytes=l2, backward=backward)
        b = simulate_l2(strategy, p, l2_bytes=l2, backward=backward, granularity="row")
        assert abs(a.read_bytes - b.read_bytes) <= 0.01 * b.read_bytes, f"reads {a.read_bytes} vs {b.read_bytes} at L2={l2}"
        assert abs(a.write_bytes - b.write_bytes) <= 0.01 * b.write_bytes


def test_standard_intermediates_spill_to_dram_when_they_do_not_fit():
    p = Problem(1, 16, 4096, 4096, 64, "fp16", False)
    c = simulate("standard", p, l2_bytes=50 * 2**20)
    assert c.dram_read_bytes >= 0.9 * c.hbm_read_bytes, "S and P (512 MB) cannot stay in a 50 MB L2"


def test_l2_arguments_are_checked():
    p = Problem(1, 1, 128, 128, 64)
    with pytest.raises(ValueError, match="l2_bytes"):
        simulate_l2("fa2", p, l2_bytes=0)
    with pytest.raises(ValueError, match="granularity"):
        simulate_l2("fa2", p, l2_bytes=1 << 20, granularity="sector")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "mma"])
def test_cuflash_backward_through_the_l2(deterministic, causal, kernels):
    """The backward launches of cuda/bwd.cuh: a huge L2 reads every input once (the fp32 buffers are
    written before they are read); an L2 smaller than a tile misses every read the counts list
    (atomics read the accumulator), when every block is whole. Deterministic, bwd_sm90_ws_kernel ("auto") adds dQ
    in a fixed order counted in an int32 per 64 rows: the counts take 4 bytes per counter written (512 / 64 per
    head by the preprocess) and per add (one per visit), the L2 a 32-byte sector per counter unit (one per
    128-query block) and per add."""
    p = Problem(1, 4, 512, 384, 64, "fp16", causal)
    r = simulate_l2("cuflash", p, l2_bytes=1 << 30, backward=True, deterministic=deterministic, kernels=kernels)
    unseen = 4 * 128 * 64 * 2 if causal else 0  # causal, Sq > Sk: Q of queries 0-127 is never read (dO is, by
    # the preprocess)
    assert r.read_bytes == 4 * ((3 * 512 + 2 * 384) * 64 * 2 + 512 * 4) - unseen, "Q, dO, O, K, V and lse once"
    c = simulate("cuflash", p, backward=True, deterministic=deterministic, kernels=kernels)
    r = simulate_l2("cuflash", p, l2_bytes=32, backward=True, deterministic=deterministic, kernels=kernels)
    sectors = deterministic and kernels == "auto"
    # visits of the 128-key blocks (128-query steps), per head: all 3 x 4; causal (diag -128) 3 + 2 + 1
    visits = (6 if causal else 12) if sectors else 0
    preprocess = 4 * (4 * 32 - 512 // 64 * 4) if sectors else 0
    assert r.read_bytes == c.hbm_read_bytes + 4 * visits * (32 - 4)
    assert r.write_bytes == c.hbm_write_bytes + 4 * visits * (32 - 4) + preprocess


def test_wgmma_kernels_are_resident_as_their_launch_bounds_say():
    """CTAs per SM: shared memory and threads for every kernel; the wgmma kernels at most CTAS_PER_SM (their
    registers are sized for exactly that many); the L2 model's forward waves follow the launched kernel."""
    from cuflash import config
    from cuflash.simulator.l2 import _resident, config_resident, ctas_per_sm

    for cfg in config.all_fwd_configs() + [c for c in config.all_bwd_configs() if hasattr(c, "smem_bytes")]:
        n = config_resident(cfg)
        assert 1 <= n <= _resident(cfg.smem_bytes, cfg.threads)
        if isinstance(cfg, (config.FwdSm90Config, config.BwdSm90Config)):
            assert n <= cfg.ctas_per_sm, cfg.cpp_name()
    p = Problem(1, 16, 4096, 4096, 128, "bf16", False)
    for kernels in ("auto", "mma"):
        cfg = config.forward_kernel_config(128, "bf16", False, kernels=kernels)
        assert ctas_per_sm("cuflash", p, kernels) == config_resident(cfg)


@pytest.mark.parametrize("causal,window,deterministic,kernels,reversed_", [
    (True, None, True, "auto", True), (False, (100, 0), True, "auto", True), (False, None, True, "auto", False),
    (True, None, False, "auto", False), (True, None, True, "mma", False)])
def test_ordered_deterministic_backward_launches_the_last_key_blocks_first(causal, window, deterministic, kernels,
                                                                           reversed_):
    """The deterministic bwd_sm90_ws_kernel (ordered dQ) with causal or a window runs key block gridDim.x - 1 -
    blockIdx.x: the L2 model takes its CTAs in that launch order (CTA 0 loads the last K block); the other
    backward main kernels run key block blockIdx.x."""
    from cuflash.simulator import l2

    p = Problem(1, 1, 512, 512, 64, "fp16", causal, window)
    tr = l2._Trace(p, "tile")
    l2._cuflash_bwd(tr, p, True, 132, deterministic, kernels)
    first, per_bh, _, rows, _ = tr.tensors["k"]
    blocks = 512 // 128  # bwd_sm90_ws_kernel and bwd_kernel take 128 keys at d 64
    assert rows * per_bh == 512
    # kernel 1, in launch order (one wave: cta = blockIdx.x): the first unit of K each CTA reads
    k_block = {}
    for kernel, _, _, cta, _, ids, _ in tr.parts:
        sel = (kernel == 1) & (ids >= first) & (ids < first + per_bh)
        for c, u in zip(cta[sel], ids[sel] - first):
            k_block.setdefault(int(c), int(u) * rows // 128)
    want = list(range(blocks))[::-1] if reversed_ else list(range(blocks))
    assert [k_block[c] for c in range(blocks)] == want
