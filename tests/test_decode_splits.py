"""The split-KV count heuristic of attention_with_kvcache (CPU: pure arithmetic)."""

import pytest

from cuflash2._kvcache import MAX_SPLITS as _MAX_SPLITS, check_num_splits as _check_num_splits, num_splits_for as _num_splits

SLOTS = 132 * 3  # H200, three decode CTAs per SM


@pytest.mark.parametrize("ctas,tiles", [(4, 64), (4, 256), (4, 1024), (32, 256), (32, 1024),
                                        (100, 300), (1, 8), (7, 5000), (300, 1024)])
def test_automatic_split_count_fills_one_wave(ctas, tiles):
    splits = _num_splits(0, ctas, tiles, SLOTS)
    assert 1 <= splits <= min(tiles, _MAX_SPLITS)
    # The splits wait for each other: the whole grid is resident at once ...
    assert splits == 1 or ctas * splits <= SLOTS
    # ... every split gets the same number of KV tiles (no trailing short splits) ...
    assert -(-tiles // -(-tiles // splits)) == splits
    # ... and no larger such count would fit.
    if ctas < 0.8 * SLOTS:
        counts = {-(-tiles // -(-tiles // s)) for s in range(1, _MAX_SPLITS + 1)}
        assert not [s for s in counts if splits < s and ctas * s <= SLOTS]


def test_a_full_grid_is_not_split():
    assert _num_splits(0, SLOTS, 1024, SLOTS) == 1
    assert _num_splits(0, -(-8 * SLOTS // 10), 1024, SLOTS) == 1  # from 80% of the slots


def test_requested_counts_are_clamped_to_the_tiles_the_maximum_and_one_wave():
    assert _num_splits(5, 4, 64, SLOTS) == 5
    assert _num_splits(500, 2, 1024, SLOTS) == _MAX_SPLITS
    assert _num_splits(50, 4, 3, SLOTS) == 3
    assert _num_splits(1, 4, 1024, SLOTS) == 1
    assert _num_splits(64, 32, 1024, SLOTS) == SLOTS // 32
    assert _num_splits(8, 2 * SLOTS, 1024, SLOTS) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_num_splits_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        _check_num_splits(bad)
