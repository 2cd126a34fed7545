"""QA 132: ParallelLayout.coords' integer check (0.10.8) refused numpy's integers, which coords took before."""

import numpy as np
import pytest
import torch

from moe_parallel import ParallelLayout


@pytest.mark.parametrize("rank", [np.int64(3), np.int32(3), torch.tensor(3)])
def test_coords_takes_numpy_integers_and_0_dim_integer_tensors_as_python_ints(rank):
    layout = ParallelLayout(2, 2, 2)
    coords = layout.coords(rank)
    assert coords == layout.coords(3)
    assert all(type(v) is int for v in (coords.rank, coords.pp_rank, coords.dp_rank, coords.ep_rank, coords.edp_rank))


@pytest.mark.parametrize("rank", ["1", 1.0, True, np.float64(1.0), torch.tensor(1.0)])
def test_coords_still_refuses_what_is_no_integer(rank):
    with pytest.raises(ValueError, match="expected an integer in"):
        ParallelLayout(2, 1, 1).coords(rank)
