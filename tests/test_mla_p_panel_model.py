"""A NumPy model of the MLA decode's P panel (sm90/mla_mainloop.cuh, store_probabilities), CPU
only: each consumer's probabilities as exp_pack leaves them (the m16n8k16 A fragments of its
k16 slices: lane (g, t) of warp w holds in a[0] row 16 w + g, keys 2t and 2t + 1 of the
slice, the lower key in the low 16 bits; a[1] the same keys of row g + 8; a[2], a[3] keys
8 + 2t, 9 + 2t), stored with stmatrix.x4 at the addresses store_probabilities gives each lane,
must make the tile's P panel the K-major A operand that latent_values' descriptors read: 64
rows of the tile's 64 keys, 16-bit, 128-byte rows with the 128-byte swizzle, key k of row r at
byte 2k of the row's swizzled chunks; and the stores' 8 rows of a matrix meet 8 bank slots."""

import numpy as np

from test_fp8_transpose_model import bank_ways, stmatrix_x4, swizzled

BLOCK_M, BLOCK_N, CONSUMERS = 64, 64, 2
KEYS_EACH = BLOCK_N // CONSUMERS


def swizzled_chunk(row, chunk):
    """swizzled_chunk<P_BYTES>(0, row, chunk): one panel, chunk c of row r at slot c ^ (r % 8)."""
    return row * 128 + ((chunk % 8) ^ (row % 8)) * 16


def fragments(p, consumer, warp, ks):
    """exp_pack's registers of every lane for k16 slice ks of `consumer`'s keys: regs[l][m]."""
    regs = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        key = KEYS_EACH * consumer + 16 * ks + 2 * t
        row = 16 * warp + g

        def pair(r, k):
            return int(p[r, k]) | (int(p[r, k + 1]) << 16)

        regs.append([pair(row, key), pair(row + 8, key), pair(row, key + 8),
                     pair(row + 8, key + 8)])
    return regs


def store_addresses(consumer, warp, ks):
    """store_probabilities' address of each lane for slice ks: row 16 w + l % 8 + 8 (m & 1) of
    matrix m = l / 8, keys from KEYS_EACH * consumer + 16 ks + 8 (m >> 1)."""
    addresses = []
    for lane in range(32):
        m = lane // 8
        row = 16 * warp + lane % 8 + 8 * (m & 1)
        key = KEYS_EACH * consumer + 16 * ks + 8 * (m >> 1)
        addresses.append(swizzled_chunk(row, key // 8))
    return addresses


def test_the_p_panel_is_the_k_major_a_operand():
    p = (np.arange(BLOCK_M * BLOCK_N, dtype=np.uint32).reshape(BLOCK_M, BLOCK_N) * 7 + 3) & 0xFFFF
    panel = np.zeros(BLOCK_M * 128, np.uint8)
    worst = 0
    for consumer in range(CONSUMERS):
        for warp in range(4):
            for ks in range(KEYS_EACH // 16):
                addresses = store_addresses(consumer, warp, ks)
                stmatrix_x4(panel, addresses, fragments(p, consumer, warp, ks))
                worst = max(worst, bank_ways(addresses))
    expected = np.zeros_like(panel)
    for r in range(BLOCK_M):
        for k in range(BLOCK_N):
            at = swizzled(r, 2 * k)
            expected[at:at + 2] = np.frombuffer(int(p[r, k]).to_bytes(2, "little"), np.uint8)
    np.testing.assert_array_equal(panel, expected)
    assert worst == 1
