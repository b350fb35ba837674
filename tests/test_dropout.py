"""The dropout mask's definition (cuflash2/dropout.py, the NumPy twin of cuda_src/dropout.cuh) and
the dropout argument checks (CPU)."""

import pytest

from cuflash2 import _validate, dropout

# Random123's known-answer vectors for Philox4x32-10 (counter, key, output).
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in dropout.philox4x32_10(*counter, *key)) == expected


def test_keep_mask_follows_the_kernels_per_lane_draw():
    # What each lane of a warp computes for a 16 x 16 block (dropout.cuh, Dropout::keep_bits),
    # written out element by element, against the vectorised mask.
    batch, nheads, seqlen_q, seqlen_k, p, seed, offset = 1, 2, 40, 50, 0.3, 99, 7
    mask = dropout.keep_mask(batch, nheads, seqlen_q, seqlen_k, p, seed, offset)
    lo, hi = dropout.split_seed(seed)
    threshold = dropout.keep_threshold(p)
    for head in range(nheads):
        for q0 in range(0, seqlen_q, 16):
            for k0 in range(0, seqlen_k, 16):
                for lane in range(32):
                    words = dropout.philox4x32_10(k0 // 16 * 4 + lane % 4, q0 // 16 * 8 + lane // 4,
                                                  head, offset, lo, hi)
                    for half in range(2):
                        for tile in range(2):
                            for e in range(2):
                                j = half * 4 + tile * 2 + e
                                u = (int(words[j // 2]) >> (16 * (j % 2))) & 0xFFFF
                                q = q0 + lane // 4 + 8 * half
                                k = k0 + 8 * tile + 2 * (lane % 4) + e
                                if q < seqlen_q and k < seqlen_k:
                                    assert mask[0, head, q, k] == (u < threshold), (head, q, k)


def test_keep_fraction_and_independence():
    mask = dropout.keep_mask(2, 4, 256, 256, 0.25, 12345)
    assert abs(mask.mean() - 0.75) < 0.01
    other = dropout.keep_mask(2, 4, 256, 256, 0.25, 12345, offset=1)
    assert abs((mask == other).mean() - (0.75**2 + 0.25**2)) < 0.01  # independent draws
    assert (dropout.keep_mask(1, 1, 64, 64, 0.25, 12345) == mask[0, 0, :64, :64]).all()


def test_keep_threshold_and_seed_split():
    assert dropout.keep_threshold(0.0) == 65536
    assert dropout.keep_threshold(0.5) == 32768
    assert dropout.split_seed(2**40 + 5) == (5, 256)


@pytest.mark.parametrize("p,seed,offset,expected", [(0.0, None, 0, (0.0, 0, 0)),
                                                    (0.1, 3, 0, (0.1, 3, 0)),
                                                    (0.5, 2**63, 2**32 - 1, (0.5, 2**63, 2**32 - 1))])
def test_check_dropout(p, seed, offset, expected):
    assert _validate.check_dropout(p, seed, offset) == expected


@pytest.mark.parametrize("p,seed,offset,exc,pattern", [
    (1.0, 1, 0, ValueError, r"dropout_p must be in \[0, 1\)"),
    (-0.1, 1, 0, ValueError, r"dropout_p must be in \[0, 1\)"),
    (float("nan"), 1, 0, ValueError, "dropout_p"),
    ("0.1", 1, 0, TypeError, "dropout_p"),
    (0.1, None, 0, ValueError, "needs seed"),
    (0.1, 1.5, 0, TypeError, "seed must be an int"),
    (0.1, -1, 0, ValueError, "seed must be in"),
    (0.1, 1, -1, ValueError, "offset must be in"),
    (0.1, 1, 2**32, ValueError, "offset must be in"),
])
def test_bad_dropout_arguments(p, seed, offset, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _validate.check_dropout(p, seed, offset)
