from __future__ import annotations

import pytest

from specserve.kv_blocks import BlockManager


def test_ensure_trim_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    t: list[int] = []
    assert bm.ensure(t, 9) and len(t) == 3 and bm.num_free == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert bm.ensure(t, 12) and len(t) == 3  # already enough
    bm.trim(t, 5)  # rollback of rejected positions
    assert len(t) == 2 and bm.num_free == 6
    bm.free(t)
    assert t == [] and bm.num_free == 8 and bm.usage == 0.0


def test_ensure_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    a: list[int] = []
    b: list[int] = []
    assert bm.ensure(a, 4)
    assert not bm.ensure(b, 4)  # needs 2, 1 free
    assert b == [] and bm.num_free == 1


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=2)
    t: list[int] = []
    bm.ensure(t, 2)
    block = t[0]
    bm.free(t)
    with pytest.raises(AssertionError):
        bm.free([block])
