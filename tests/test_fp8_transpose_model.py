"""A NumPy model of the FP8 forward's in-kernel transpose of V (sm90/fwd_transpose_v.cuh), CPU
only: the raw tile as the TMA writes it (the caller's V, rows of keys, 128-byte swizzle), what
ldmatrix.x4.trans gives each lane, the two byte permutes, what stmatrix.x4 writes where, replayed
with the CUDA's own index arithmetic (each function below mirrors one of the header's), and the
resulting tile of the ring compared with the keys-last V that P V's descriptors read (issue_pv)
and that the operand pass it replaces wrote (VT panels of 128 key bytes by head-dim rows,
128-byte swizzle; the head-dim rows in transposed_row's order, which keeps stmatrix off
shared bank conflicts and O's columns in order after unpermute_o_columns; within each group of 32 keys, position 4t + b of a 16-position half holds key
2t + (b & 1) + 8 (b >> 1) of that half: the order pack_probabilities_e4m3 packs P in), for every
head dim and tile of _dispatch.E4M3_SM90_FWD_TILES and the wider key tiles of
_dispatch.E4M3_WIDE_TILES (160-224 keys: a last panel of 32-key groups, the rest of its rows
left as they were).

Fragment layouts (PTX ISA, "Warp-level matrix load / store instructions: ldmatrix, stmatrix"):
an 8 x 8 matrix of 16-bit elements has its 8 rows (16 bytes each) at the addresses lanes
8 m .. 8 m + 7 supply (matrix m of an .x4); lane l holds, in register m, row l / 4, elements
2 (l % 4) and 2 (l % 4) + 1 (the lower in the low half). With .trans, ldmatrix hands lane l
elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) of the matrix as stored, i.e. row l / 4 of
its transpose. stmatrix without .trans stores the first layout.
"""

import numpy as np
import pytest

from cuflash2 import _configs, _dispatch

ROW_BYTES = 128  # a swizzled panel's row (Sm90CtaLayout::ROW_BYTES)
#: The producer warpgroup's warps that transpose (FwdSm90Traits::TRANSPOSE_WARPS: warps 1-3;
#: warp 0's thread 0 issues the TMA loads).
TRANSPOSE_WARPS = _configs.SM90_TRANSPOSE_V_WARPS


# ---- shared memory as the TMA writes it (CU_TENSOR_MAP_SWIZZLE_128B, 1024-byte-aligned) ------

def swizzled(row, byte):
    """Byte `byte` (0 .. 127) of row `row` of a 128-byte-swizzled panel: chunk c (16 bytes) of
    row r at slot c ^ (r % 8)."""
    return row * ROW_BYTES + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def tma_raw_tile(v_tile, block_n, v_panels):
    """The raw V tile (block_n keys x head dim bytes) as the TMA lands it from v_map: V_PANELS
    panels of block_n rows of 128 head-dim bytes (zero past the head dim), KV_PANEL_BYTES apart."""
    panel_bytes = block_n * ROW_BYTES
    smem = np.zeros(v_panels * panel_bytes, np.uint8)
    for key in range(block_n):
        for h in range(v_tile.shape[1]):
            smem[(h // ROW_BYTES) * panel_bytes + swizzled(key, h % ROW_BYTES)] = v_tile[key, h]
    return smem


def e4m3_key_at_position(pos):
    """The key (within its group of 32) that position pos of a keys-last V row holds (P's order:
    pack_probabilities_e4m3, hopper_primitives.cuh)."""
    half, t, b = pos // 16, (pos % 16) // 4, pos % 4
    return 16 * half + 2 * t + (b & 1) + 8 * (b >> 1)


def transposed_row(h):
    """transposed_row: the stage's row of V's head-dim row h (rows 8-15 of every 16 trade places
    in pairs)."""
    return h ^ ((h >> 3) & 1)


def expected_vt_stage(v_tile, block_n, head_dim):
    """The ring's V tile as P V reads it (as the operand pass wrote V keys-last and the TMA
    loaded it, but for the head-dim rows' order): VT_PANELS panels (128 keys each) of head_dim
    rows of 128 key positions, 128-byte swizzle, V's head-dim row h in row transposed_row(h)."""
    vt_panel_bytes = head_dim * ROW_BYTES
    smem = np.zeros(-(-block_n // ROW_BYTES) * vt_panel_bytes, np.uint8)
    for h in range(head_dim):
        for key_pos in range(block_n):
            group = key_pos // 32 * 32
            key = group + e4m3_key_at_position(key_pos % 32)
            panel, pos = key_pos // ROW_BYTES, key_pos % ROW_BYTES
            smem[panel * vt_panel_bytes + swizzled(transposed_row(h), pos)] = v_tile[key, h]
    return smem


# ---- the warp instructions --------------------------------------------------------------------

def words_at(smem, address):
    """The four 32-bit words (little-endian) of the 16 bytes at `address`."""
    return [int.from_bytes(bytes(smem[address + 4 * i:address + 4 * i + 4]), "little")
            for i in range(4)]


def ldmatrix_x4_trans(smem, addresses):
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: `addresses[l]` the row address lane l
    supplies; returns regs[l][m], lane l's register m."""
    regs = [[0] * 4 for _ in range(32)]
    for m in range(4):
        rows = [words_at(smem, addresses[8 * m + r]) for r in range(8)]
        halves = [[(rows[r][c // 2] >> (16 * (c % 2))) & 0xFFFF for c in range(8)]
                  for r in range(8)]  # the matrix as stored: halves[row][column]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            regs[lane][m] = halves[2 * t][g] | (halves[2 * t + 1][g] << 16)
    return regs


def stmatrix_x4(smem, addresses, regs):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16 (no .trans): lane l's register m is row l / 4,
    word l % 4 of matrix m, whose row r goes to addresses[8 m + r]; returns the row addresses
    written (for the bank count)."""
    for m in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            address = addresses[8 * m + g] + 4 * t
            smem[address:address + 4] = np.frombuffer(regs[lane][m].to_bytes(4, "little"),
                                                      np.uint8)


def byte_perm(a, b, selector):
    """__byte_perm(a, b, selector) (prmt.b32 default mode): byte i of the result is byte
    (selector >> 4 i) & 7 of the 8 bytes b:a."""
    pool = (a | (b << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def bank_ways(addresses, group_rows=8):
    """The most 16-byte row accesses of one 8-row phase that fall on the same four banks (1:
    conflict-free): ldmatrix / stmatrix serve each matrix's 8 rows together."""
    worst = 1
    for m in range(0, len(addresses), group_rows):
        slots = [(a // 16) % 8 for a in addresses[m:m + group_rows]]
        worst = max(worst, max(slots.count(s) for s in set(slots)))
    return worst


# ---- the transposer's index arithmetic (sm90/fwd_transpose_v.cuh, one function each) ----------

class Shape:
    """FwdSm90Traits' numbers the transposer uses."""

    def __init__(self, head_dim, block_n):
        self.head_dim = head_dim
        self.block_n = block_n
        self.v_panels = -(-head_dim // ROW_BYTES)      # V_PANELS (e4m3: 128 bytes a panel)
        self.vt_panels = -(-block_n // ROW_BYTES)      # VT_PANELS (128 keys a panel)
        self.tail_groups = block_n % ROW_BYTES // 32   # VT_TAIL_GROUPS (a last panel's)
        self.kv_panel_bytes = block_n * ROW_BYTES      # KV_PANEL_BYTES
        self.vt_panel_bytes = head_dim * ROW_BYTES     # VT_PANEL_BYTES
        self.units = self.vt_panels * (head_dim // 16)  # TRANSPOSE_UNITS


def raw_lane_offset(lane):
    """raw_lane_offset: lane l reads key l of a group of 32 (row l % 8 of the group's matrix
    l / 8: keys 0-7, 8-15, 16-23, 24-31), chunk 0 of the row in its swizzled slot; a step XORs
    its chunk in (bits 4-6; the row's bits lie above)."""
    return lane * ROW_BYTES + ((lane & 7) << 4)


def vt_lane_offset(lane):
    """vt_lane_offset: lane l supplies row l % 8 of stmatrix's matrix l / 8; matrices 0 and 2
    are the even head-dim rows, 1 and 3 the odd ones (hr = 2 (l % 8) + (l / 8) % 2), 2 and 3
    the second 16 positions of the group of 32 (chunk l / 16 of the group's two), in their
    swizzled slot for the stage's row transposed_row(hr); a step XORs the group's first chunk
    in."""
    row = transposed_row(2 * (lane & 7) + ((lane >> 3) & 1))
    return row * ROW_BYTES + ((((lane >> 4) ^ row) & 7) << 4)


def unit_addresses(raw_lane, vt_lane, u, shape):
    """transpose_unit's row addresses of a lane for unit u (head-dim chunk c = u / VT_PANELS,
    VT panel p = u % VT_PANELS): [(ldmatrix's, stmatrix's) for steps i = 0 .. 3, key group
    4 p + i; the last panel's first VT_TAIL_GROUPS steps where the keys end inside it].
    raw_lane, vt_lane: the tiles' (1024-byte aligned) addresses plus the lane's offsets."""
    c, p = u // shape.vt_panels, u % shape.vt_panels
    raw = ((raw_lane + (c // 8) * shape.kv_panel_bytes) ^ ((c % 8) << 4)) + p * 128 * ROW_BYTES
    vt = vt_lane + p * shape.vt_panel_bytes + c * 16 * ROW_BYTES
    steps = shape.tail_groups if shape.tail_groups and p == shape.vt_panels - 1 else 4
    return [(raw + i * 32 * ROW_BYTES, vt ^ ((2 * i) << 4)) for i in range(steps)]


#: transpose_unit's byte permutes: of the words of keys 2t, 2t + 1 (a) and 8 + 2t, 9 + 2t (b) of
#: head-dim bytes 2g and 2g + 1, the even bytes (head dim 2g) and the odd ones (2g + 1).
EVEN_BYTES, ODD_BYTES = 0x6420, 0x7531


def transpose_tile(raw, shape, warps=TRANSPOSE_WARPS, raw_base=0, vt_base=0):
    """transpose_v_tiles on one tile: every transposer warp's units (u = warp, warp + warps,
    ...) on the raw tile `raw` (at raw_base, 1024-byte aligned) into a fresh stage (at
    vt_base); returns (stage, the worst ldmatrix and stmatrix bank ways, how many times each
    unit ran)."""
    stage = np.zeros(shape.vt_panels * shape.vt_panel_bytes, np.uint8)
    lds_ways = sts_ways = 0
    runs = np.zeros(shape.units, int)
    for warp in range(warps):
        for u in range(warp, shape.units, warps):
            runs[u] += 1
            lanes = [unit_addresses(raw_base + raw_lane_offset(lane),
                                    vt_base + vt_lane_offset(lane), u, shape)
                     for lane in range(32)]
            for i in range(len(lanes[0])):
                loads = [lanes[lane][i][0] - raw_base for lane in range(32)]
                stores = [lanes[lane][i][1] - vt_base for lane in range(32)]
                d = ldmatrix_x4_trans(raw, loads)
                regs = [[byte_perm(r[0], r[1], EVEN_BYTES), byte_perm(r[0], r[1], ODD_BYTES),
                         byte_perm(r[2], r[3], EVEN_BYTES), byte_perm(r[2], r[3], ODD_BYTES)]
                        for r in d]
                stmatrix_x4(stage, stores, regs)
                lds_ways = max(lds_ways, bank_ways(loads))
                sts_ways = max(sts_ways, bank_ways(stores))
    return stage, lds_ways, sts_ways, runs


TILES = [(d, block_n) for d, (block_n, *_) in _dispatch.E4M3_SM90_FWD_TILES.items()] + [
    (d, block_n) for d, tiles in _dispatch.E4M3_WIDE_TILES.items() for block_n, *_ in tiles]


@pytest.mark.parametrize("head_dim,block_n", TILES, ids=[f"d{d}-n{n}" for d, n in TILES])
def test_the_transposed_tile_is_the_keys_last_tile(head_dim, block_n):
    """Random bytes of V (every byte value, so a misplaced byte shows): the transposer's stage
    equals the keys-last tile (the operand pass's, as the TMA loaded it), every unit run once."""
    rng = np.random.default_rng(head_dim + block_n)
    v_tile = rng.integers(0, 256, (block_n, head_dim), dtype=np.uint8)
    shape = Shape(head_dim, block_n)
    raw = tma_raw_tile(v_tile, block_n, shape.v_panels)
    # Tiles anywhere 1024-byte aligned in shared memory (a raw buffer, a ring stage).
    stage, lds_ways, sts_ways, runs = transpose_tile(raw, shape, raw_base=5 << 10,
                                                     vt_base=37 << 10)
    assert (runs == 1).all()
    np.testing.assert_array_equal(stage, expected_vt_stage(v_tile, block_n, head_dim))
    # ldmatrix's rows (8 consecutive keys, one chunk) are conflict-free, and so are stmatrix's
    # (even or odd head-dim rows, in place two at a slot: transposed_row's reason).
    assert (lds_ways, sts_ways) == (1, 1)


def test_o_columns_come_back_in_order():
    """P V with the stage's rows in transposed_row's order gives O's column n at accumulator
    column transposed_row(n); unpermute_o_columns' swaps (elements 0 and 1, 2 and 3 of every
    odd n8 tile: a thread's columns 8 dt + 2t and + 1) put each back."""
    for d_tiles in (8, 16, 32):  # head dims 64, 128, 256
        logical = np.arange(8 * d_tiles)
        physical = np.array([transposed_row(n) for n in logical])  # column n holds V row p(n)
        acc = np.empty((d_tiles, 4, 4), int)  # [dt][element][t]: the V row each one holds
        for dt in range(d_tiles):
            for t in range(4):
                for e in range(4):
                    acc[dt, e, t] = physical[8 * dt + 2 * t + e % 2]
        for dt in range(1, d_tiles, 2):
            acc[dt] = acc[dt][[1, 0, 3, 2]]
        for dt in range(d_tiles):
            for t in range(4):
                for e in range(4):
                    assert acc[dt, e, t] == 8 * dt + 2 * t + e % 2


def test_the_byte_permutes_give_the_operand_pass_words():
    """One 16 x 16 block: a lane's two loads and permutes hold, for head-dim bytes 2g and
    2g + 1, keys 2t, 2t + 1, 8 + 2t, 9 + 2t: the word of positions 4t .. 4t + 3 (P's order)."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (16, 16), dtype=np.uint8)  # [key][head-dim byte]
    smem = np.zeros(16 * 16, np.uint8)
    smem[:] = block.reshape(-1)
    addresses = [16 * (lane % 16) for lane in range(32)]  # keys 0-7, 8-15 (twice)
    d = ldmatrix_x4_trans(smem, addresses)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for selector, h in ((EVEN_BYTES, 2 * g), (ODD_BYTES, 2 * g + 1)):
            word = byte_perm(d[lane][0], d[lane][1], selector).to_bytes(4, "little")
            keys = [e4m3_key_at_position(4 * t + b) for b in range(4)]
            assert list(word) == [block[k, h] for k in keys]
