"""The split-KV heuristic of attention_with_kvcache (cuflash._families.num_splits_heuristic), checked against
a brute-force model of the launch: CTAs run in waves of num_sms * ctas_per_sm, so the fraction of the
slot-time that does work is waves / ceil(waves); splits keep 4 key tiles each unless the cache is so short that
the launch stays under one wave, where they may go down to one tile, up to one wave."""
import math

import pytest

from cuflash._families import MAX_SPLITS, num_splits_heuristic


def fill(ctas, splits, slots):
    waves = ctas * splits / slots
    return waves / math.ceil(waves)


@pytest.mark.parametrize("num_sms, per_sm", [(132, 2), (132, 3), (108, 2), (78, 1)])
@pytest.mark.parametrize("ctas", [1, 3, 8, 32, 64, 100, 200, 263, 264, 400, 900])
@pytest.mark.parametrize("key_blocks", [1, 4, 7, 64, 512, 2048])
def test_the_split_fills_the_waves(num_sms, per_sm, ctas, key_blocks):
    s = num_splits_heuristic(ctas, key_blocks, num_sms, per_sm)
    slots = num_sms * per_sm
    most = max(1, min(key_blocks // 4, MAX_SPLITS))
    if ctas * most < slots:  # a short cache: finer splits, up to one wave
        most = max(most, min(key_blocks, MAX_SPLITS, slots // ctas))
    assert 1 <= s <= most
    if ctas >= 4 * slots:
        assert s == 1
        return
    best = max(fill(ctas, t, slots) for t in range(1, most + 1))
    if best >= 0.95:  # the smallest factor that fills the waves to 95%
        assert fill(ctas, s, slots) >= 0.95
        assert all(fill(ctas, t, slots) < 0.95 for t in range(1, s))
    else:  # none does: the fullest
        assert fill(ctas, s, slots) == best


def test_the_h100_decode_cases():
    # B=8, 8 K/V heads, one 64-row block each: 64 CTAs on 132 SMs x 2 -> 4 splits make one 97% wave
    # (5 splits, the old rule, made 1.2 waves)
    assert num_splits_heuristic(64, 512, 132, 2) == 4
    # B=1: 8 CTAs -> 32 splits, 256 of 264 slots
    assert num_splits_heuristic(8, 512, 132, 2) == 32
    # a short cache that leaves the machine idle even at 4 key tiles per split: one tile per split
    assert num_splits_heuristic(8, 16, 132, 2) == 16
    # ... but not past one wave
    assert num_splits_heuristic(64, 16, 132, 2) == 4


def test_the_h100_decode_cases_at_one_cta_per_sm():
    """What the library asks for on an H100 (one CTA per SM, measured best there): one wave of single CTAs, 128 of
    132 SMs, at every batch of the decode benchmark."""
    assert num_splits_heuristic(8, 512, 132, 1) == 16    # B=1, 8 K/V heads
    assert num_splits_heuristic(16, 512, 132, 1) == 8    # B=2
    assert num_splits_heuristic(32, 1024, 132, 1) == 4   # B=4
    assert num_splits_heuristic(64, 512, 132, 1) == 2    # B=8
    assert num_splits_heuristic(8, 16, 132, 1) == 16     # B=1, 1024 keys: 16 splits of one 64-key tile
    assert num_splits_heuristic(64, 16, 132, 1) == 2     # B=8, 1024 keys
    assert num_splits_heuristic(512, 16, 132, 1) == 1    # B=64, 1024 keys: four waves of whole sequences


# (memory clock in kHz, bus width in bits, SMs) as the driver reports them, and the CTAs per SM the decode launch
# then aims at: two where the DRAM bandwidth per SM is at least DECODE_TWO_CTAS_GBPS_PER_SM (30 GB/s)
DEVICES = {
    "H100 SXM": ((2619000, 5120, 132), 1),    # 3.35 TB/s, 25 GB/s per SM: measured, one CTA per SM faster
    "H200": ((3201000, 6144, 132), 2),        # 4.92 TB/s, 37 GB/s per SM: measured, two CTAs per SM faster
    "A100 80GB SXM": ((1593000, 5120, 108), 1),
    "H100 PCIe": ((1593000, 5120, 114), 1),
    "RTX 4090": ((10501000, 384, 128), 1),
}


@pytest.mark.parametrize("name", DEVICES)
def test_decode_ctas_per_sm_follow_the_dram_bandwidth_per_sm(name, monkeypatch):
    from cupy.cuda import runtime

    from cuflash import _families

    (clock, bus, sms), want = DEVICES[name]
    attrs = {runtime.cudaDevAttrMemoryClockRate: clock, runtime.cudaDevAttrGlobalMemoryBusWidth: bus,
             runtime.cudaDevAttrMultiProcessorCount: sms}
    monkeypatch.setattr(runtime, "deviceGetAttribute", lambda attr, device: attrs[attr])
    monkeypatch.setattr(_families, "_num_sms", {})
    monkeypatch.setattr(_families, "_decode_ctas", {})
    assert _families.dram_gbps(0) == pytest.approx(2 * clock * 1e3 * bus / 8 / 1e9)
    assert _families.decode_ctas_per_sm(0) == want


def test_decode_ctas_per_sm_is_one_without_a_reported_bandwidth(monkeypatch):
    from cupy.cuda import runtime

    from cuflash import _families

    def attribute(attr, device):
        if attr == runtime.cudaDevAttrMultiProcessorCount:
            return 132
        raise runtime.CUDARuntimeError(1)

    monkeypatch.setattr(runtime, "deviceGetAttribute", attribute)
    monkeypatch.setattr(_families, "_num_sms", {})
    monkeypatch.setattr(_families, "_decode_ctas", {})
    assert _families.dram_gbps(0) is None
    assert _families.decode_ctas_per_sm(0) == 1


def test_degenerate_launches_are_not_split():
    assert num_splits_heuristic(0, 100, 132, 2) == 1
    assert num_splits_heuristic(10, 0, 132, 2) == 1
    assert num_splits_heuristic(10, 3, 132, 2) == 3  # short: one tile per split
    assert num_splits_heuristic(10, 1, 132, 2) == 1
    assert num_splits_heuristic(10_000, 4096, 132, 2) == 1


@pytest.mark.parametrize("smem_per_sm,reserved", [(233472, 1024), (167936, 1024), (102400, 1024)])
@pytest.mark.parametrize("smem", [0, 20480, 28672, 36864, 57344, 61440, 81920])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_capped_shared_memory_leaves_room_for_exactly_n_ctas(smem_per_sm, reserved, smem, n):
    """_launch.capped_smem_bytes (the decode launch's cap, _families.DECODE_MAX_CTAS_PER_SM): n CTAs of the result
    fit an SM (each also taking `reserved`), n + 1 do not unless the kernel's own shared memory already keeps them
    out, and the result never drops below the kernel's own; a cap that not even n CTAs fit is refused."""
    from cuflash import _launch

    if n * (smem + reserved) > smem_per_sm:
        with pytest.raises(ValueError, match=f"ctas_per_sm={n}"):
            _launch.capped_smem_bytes(smem, n, smem_per_sm, reserved)
        return
    got = _launch.capped_smem_bytes(smem, n, smem_per_sm, reserved)
    fits = smem_per_sm // (got + reserved)
    assert got >= smem and fits >= n
    assert fits == n or got == smem, (got, fits)
    assert got == smem or smem_per_sm // (got - 1 + reserved) > n  # the least that keeps the (n + 1)-th out
