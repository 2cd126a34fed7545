import math
import random

import pytest
import torch

from moe_ckpt import Box, FlatRange, even_split, split_flat_buffer
from moe_ckpt.geometry import contiguous_boxes, intersect


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (4, 1, 3, 2), (1, 1, 6), (5, 0, 2)])
def test_contiguous_boxes_tile_the_flat_range_in_row_major_order(shape):
    numel = math.prod(shape)
    ids = torch.arange(numel).reshape(shape)
    rng = random.Random(0)
    for _ in range(50):
        a = rng.randint(0, numel)
        b = rng.randint(a, numel)
        pieces = contiguous_boxes(shape, FlatRange(a, b - a))
        got = []
        for pos, box in pieces:
            block = ids[box.slices()].reshape(-1)
            assert block.tolist() == list(range(a + pos, a + pos + box.numel)), (shape, a, b, box)
            got += block.tolist()
        assert got == list(range(a, b))
        assert len(pieces) <= max(1, 2 * len(shape) - 1)


def test_scalar_flat_range_is_one_empty_box():
    assert contiguous_boxes((), FlatRange(0, 1)) == [(0, Box((), ()))]


def test_intersect_of_disjoint_boxes_is_none_and_of_overlapping_is_the_common_part():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert intersect(a, b) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None


def test_even_split_covers_n_with_lengths_differing_by_at_most_one():
    parts = [even_split(10, r, 4) for r in range(4)]
    assert parts == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="rank=4"):
        even_split(10, 4, 4)


def test_split_flat_buffer_maps_a_zero_range_onto_the_tensors_it_spans():
    assert split_flat_buffer([6, 4, 10], 5, 7) == [(0, FlatRange(5, 1)), (1, FlatRange(0, 4)), (2, FlatRange(0, 2))]
    with pytest.raises(ValueError, match="exceeds the buffer of 20"):
        split_flat_buffer([6, 4, 10], 15, 6)


def test_box_outside_the_global_shape_is_refused_with_both_named():
    from moe_ckpt import ShardSpec

    with pytest.raises(ValueError, match=r"exceeds dim 0 of global shape \(4, 2\)"):
        ShardSpec("w", (4, 2), torch.zeros(3, 2), Box.dim0((4, 2), 2, 3))
