"""cuflash.philox: Philox4x32-10 against the Random123 known answers and a scalar Python-int version, and the
dropout keep-mask the kernels generate (counter layout, 2 x 2 grouping, threshold, statistics)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from cuflash import philox

KATS = [  # (counter, key, output): Philox4x32-10 known answers of Random123 (examples/kat_vectors)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ((1, 0, 0, 0), (1, 0), (0xAC08141B, 0xDFC5CCBE, 0x79C07A47, 0xA7F66093)),
    ((0, 0, 0, 0x80000000), (0, 0xFFFFFFFF), (0x2A460458, 0x0A2709E5, 0x47BC9115, 0x0F96D8AF)),
]


def philox_scalar(counter, key):
    """Philox4x32-10 on Python ints, one counter at a time: ten rounds of two 64-bit products, the key bumped
    by the Weyl constants in between."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 % 2**32, (p0 >> 32) ^ c3 ^ k1, p0 % 2**32
    return c0, c1, c2, c3


def mask_by_loop(batch, heads, sq, sk, p, seed, offset):
    """The dropout mask one element at a time from its own Philox call (no grouping exploited)."""
    threshold = min(round(p * 2**32), 2**32 - 1)
    mask = np.zeros((batch, heads, sq, sk), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(sq):
                for j in range(sk):
                    words = philox_scalar((j // 2, i // 2, b * heads + h, offset), (seed % 2**32, seed // 2**32))
                    mask[b, h, i, j] = words[2 * (i % 2) + j % 2] >= threshold
    return mask


@pytest.mark.parametrize("counter,key,expected", KATS, ids=[f"kat{n}" for n in range(len(KATS))])
def test_philox_known_answers(counter, key, expected):
    got = tuple(int(w) for w in philox.philox4x32_10(counter, key))
    assert got == expected, f"philox{counter} key {key}: {[hex(w) for w in got]}"
    assert philox_scalar(counter, key) == expected


def test_vectorized_philox_equals_the_scalar_one():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, size=(4, 200), dtype=np.uint64)
    key = (0xDEADBEEF, 0x01234567)
    words = philox.philox4x32_10(tuple(counters), key)
    assert all(w.dtype == np.uint32 and w.shape == (200,) for w in words)
    for n in range(200):
        want = philox_scalar(tuple(int(c) for c in counters[:, n]), key)
        assert tuple(int(w[n]) for w in words) == want, f"counter {counters[:, n]}"


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 2, 4, 4), (1, 1, 1, 9), (2, 1, 6, 1)], ids=str)
@pytest.mark.parametrize("p,seed,offset", [(0.3, 0, 0), (0.5, 2**64 - 1, 2**32 - 1), (0.1, 0x123456789ABC, 77)])
def test_dropout_mask_is_the_per_element_definition(shape, p, seed, offset):
    np.testing.assert_array_equal(philox.dropout_mask(*shape, p, seed, offset), mask_by_loop(*shape, p, seed, offset))


def test_one_philox_call_fills_a_2x2_group():
    """Rows 2gi, 2gi + 1 and columns 2gj, 2gj + 1 of (b, h) are the words of the call with counter
    (gj, gi, b * H + h, offset), in the order (i & 1, j & 1) = (0, 0), (0, 1), (1, 0), (1, 1)."""
    batch, heads, sq, sk, seed, offset = 2, 3, 6, 8, 0xFEEDFACE12345678, 9
    words = philox.dropout_words(batch, heads, sq, sk, seed, offset)
    assert words.dtype == np.uint32 and words.shape == (batch, heads, sq, sk)
    for b, h, gi, gj in np.ndindex(batch, heads, sq // 2, sk // 2):
        call = philox.philox4x32_10((gj, gi, b * heads + h, offset), (seed & 0xFFFFFFFF, seed >> 32))
        group = words[b, h, 2 * gi:2 * gi + 2, 2 * gj:2 * gj + 2]
        assert group.ravel().tolist() == [int(w) for w in call], (b, h, gi, gj)


def test_odd_lengths_are_the_top_left_of_the_even_ones():
    """A group cut by the sequence end keeps the words it has: the mask of (5, 7) is that of (6, 8) cropped."""
    np.testing.assert_array_equal(philox.dropout_mask(2, 2, 5, 7, 0.4, 3, 1),
                                  philox.dropout_mask(2, 2, 6, 8, 0.4, 3, 1)[:, :, :5, :7])


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_p(p):
    mask = philox.dropout_mask(2, 4, 256, 384, p, seed=1234, offset=5)
    assert mask.dtype == bool and mask.shape == (2, 4, 256, 384)
    assert abs(mask.mean() - (1 - p)) < 0.01, f"p={p}: kept {mask.mean():.4f}"
    if p == 0:
        assert mask.all()
    for b, h in np.ndindex(2, 4):  # every (b, h) slice, and each parity class of (i, j), has the right rate
        for ri, rj in np.ndindex(2, 2):
            assert abs(mask[b, h, ri::2, rj::2].mean() - (1 - p)) < 0.03, (b, h, ri, rj)


def test_threshold():
    assert philox.dropout_threshold(0.0) == 0
    assert philox.dropout_threshold(0.5) == 2**31
    assert philox.dropout_threshold(0.25) == 2**30
    assert philox.dropout_threshold(1 - 2.0**-40) == 2**32 - 1  # rounds to 2^32: clamped
    assert philox.dropout_threshold(2.0**-33) == 0 and philox.dropout_threshold(3 * 2.0**-33) == 2  # half to even
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            philox.dropout_threshold(bad)


def test_masks_differ_across_seeds_offsets_heads_and_batches_and_repeat_exactly():
    base = philox.dropout_mask(2, 2, 64, 64, 0.5, seed=7, offset=0)
    np.testing.assert_array_equal(base, philox.dropout_mask(2, 2, 64, 64, 0.5, seed=7, offset=0))
    others = {
        "seed": philox.dropout_mask(2, 2, 64, 64, 0.5, seed=8, offset=0),
        "seed high word": philox.dropout_mask(2, 2, 64, 64, 0.5, seed=7 + 2**32, offset=0),
        "offset": philox.dropout_mask(2, 2, 64, 64, 0.5, seed=7, offset=1),
    }
    for what, other in others.items():
        agree = (other == base).mean()
        assert 0.45 < agree < 0.55, f"changing the {what} left {agree:.3f} of the mask as it was"
    for a, b in [((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 1), (1, 0))]:  # every (b, h) slice is its own stream
        agree = (base[a] == base[b]).mean()
        assert 0.45 < agree < 0.55, f"slices {a} and {b} agree on {agree:.3f}"


def test_varlen_masks_take_the_sequence_index_as_the_batch_index():
    lens_q, lens_k = [3, 0, 5, 4], [4, 2, 0, 6]
    masks = philox.dropout_mask_varlen(lens_q, lens_k, 3, 0.3, seed=99, offset=4)
    assert [m.shape for m in masks] == [(3, sq, sk) for sq, sk in zip(lens_q, lens_k)]
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        # sequence b is batch index b of a dense batch of equal-length sequences
        np.testing.assert_array_equal(masks[b], philox.dropout_mask(b + 1, 3, sq, sk, 0.3, 99, 4)[b])
        np.testing.assert_array_equal(masks[b], mask_by_loop(b + 1, 3, sq, sk, 0.3, 99, 4)[b])


def test_large_mask_is_vectorized():
    """16.8 M mask elements: vectorized NumPy takes about a second (2.2 s under a loaded 8-worker test run, which a
    2-second bound failed); a per-element Python loop would take minutes. The bound catches the loop, not speed."""
    start = time.perf_counter()
    mask = philox.dropout_mask(1, 4, 2048, 2048, 0.1, seed=2**63 + 5, offset=3)
    elapsed = time.perf_counter() - start
    assert mask.shape == (1, 4, 2048, 2048)
    assert elapsed < 30.0, f"dropout_mask(1, 4, 2048, 2048) took {elapsed:.2f} s: not vectorized?"


def test_bad_seed_and_offset():
    with pytest.raises(ValueError, match="seed=18446744073709551616"):
        philox.dropout_mask(1, 1, 2, 2, 0.1, seed=2**64)
    with pytest.raises(ValueError, match="offset=-1"):
        philox.dropout_mask(1, 1, 2, 2, 0.1, seed=1, offset=-1)
    with pytest.raises(TypeError, match="seed=1.5"):
        philox.dropout_mask(1, 1, 2, 2, 0.1, seed=1.5)
