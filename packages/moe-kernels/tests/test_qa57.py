"""QA 57: moe-kernels alone inside another training stack, on the CPU.

A hand-built RouteMap: counts given as floats or strings, a list where a tensor goes, float index
tensors or tensors on two devices were taken (or failed later, deep inside); a sort_order / dest_row
pair that is not a permutation and its inverse gave silently wrong rows. Construction now checks the
metadata (no host read) and `RouteMap.validate()` (opt-in, one host read) the values. The installed
package had no `py.typed`, so type checkers ignored its hints. Integer, complex and fp8 rows reached
the SwiGLU experts and failed inside torch ("silu_cpu not implemented") or after both GEMMs.
"""

import dataclasses
import importlib.resources

import pytest
import torch

from moe_kernels import RouteMap, build_route_map, moe_ffn, permute, swiglu_experts

T, D, H, E, K = 6, 8, 4, 5, 2


def _map(backend="torch"):
    ids = torch.rand(T, E, generator=torch.Generator().manual_seed(0)).topk(K, dim=1).indices
    return build_route_map(ids, E, backend=backend)


def test_validate_accepts_built_maps_and_returns_them():
    rm = _map()
    assert rm.validate() is rm
    assert build_route_map(torch.zeros(0, 3, dtype=torch.int64), 4).validate().num_rows == 0


def _swapped_dest_rows(rm):
    dest = rm.dest_row.clone()
    dest[[0, 2]] = dest[[2, 0]]  # rows of two different tokens
    return dataclasses.replace(rm, dest_row=dest)


def _duplicate_sort_order(rm):
    order = rm.sort_order.clone()
    order[3] = order[2]
    return dataclasses.replace(rm, sort_order=order)


def _sort_order_out_of_range(rm):
    return dataclasses.replace(rm, sort_order=rm.sort_order + 1)


def _offsets_not_cumsum(rm):
    offsets = rm.offsets.clone()
    offsets[0] += 1
    return dataclasses.replace(rm, offsets=offsets)


def _counts_not_summing_to_rows(rm):
    counts, offsets = rm.counts.clone(), rm.offsets.clone()
    counts[-1] += 1
    offsets[-1] += 1
    return dataclasses.replace(rm, counts=counts, offsets=offsets)


def _negative_count(rm):
    counts = rm.counts.clone()
    counts[0], counts[1] = -1, counts[1] + counts[0] + 1
    return dataclasses.replace(rm, counts=counts)


@pytest.mark.parametrize(
    "damage, match",
    [
        (_swapped_dest_rows, r"RouteMap.dest_row\[sort_order\[\d+\]\]=\d+: expected dest_row\[sort_order\[r\]\] == r"),
        (_duplicate_sort_order, r"RouteMap.dest_row\[sort_order\[3\]\]=.*inverse of sort_order, a permutation"),
        (_sort_order_out_of_range, r"RouteMap.sort_order\[\d+\]=12: expected a row in \[0, T\*k=12\)"),
        (_offsets_not_cumsum, r"RouteMap.offsets\[0\]=\d+: expected cumsum\(counts\)"),
        (_counts_not_summing_to_rows, r"RouteMap.counts sum to 13, expected T\*k=12"),
        (_negative_count, r"RouteMap.counts\[0\]=-1: expected >= 0"),
    ],
)
def test_validate_names_the_first_inconsistent_value_of_a_hand_built_map(damage, match):
    bad = damage(_map())
    with pytest.raises(ValueError, match=match):
        bad.validate()


def test_an_inverse_pair_that_disagrees_gave_wrong_rows_silently_and_validate_catches_it():
    """Why validate exists: the ops trust sort_order and dest_row (checking them costs a host read)."""
    rm = _map()
    bad = _swapped_dest_rows(rm)
    x = torch.randn(T, D)
    rows = permute(x, bad)
    assert not torch.equal(rows.index_select(0, bad.dest_row), x.repeat_interleave(K, 0))
    with pytest.raises(ValueError, match="dest_row"):
        bad.validate()


def test_route_map_construction_refuses_bad_metadata_by_name():
    rm = _map()
    parts = dict(counts=rm.counts, offsets=rm.offsets, sort_order=rm.sort_order, dest_row=rm.dest_row)
    with pytest.raises(ValueError, match=r"RouteMap.num_tokens=6.0 must be an integer"):
        RouteMap(6.0, K, E, **parts)
    with pytest.raises(ValueError, match=r"RouteMap.top_k='2' must be an integer"):
        RouteMap(T, "2", E, **parts)
    with pytest.raises(ValueError, match=r"RouteMap.num_experts=True must be an integer"):
        RouteMap(T, K, True, **parts)
    with pytest.raises(TypeError, match=r"RouteMap.counts must be a torch.Tensor .*got list"):
        RouteMap(T, K, E, **{**parts, "counts": rm.counts.tolist()})
    with pytest.raises(ValueError, match=r"RouteMap.sort_order must be an integer tensor, got dtype=torch.float32"):
        RouteMap(T, K, E, **{**parts, "sort_order": rm.sort_order.float()})
    with pytest.raises(ValueError, match=r"RouteMap.dest_row must be an integer tensor, got dtype=torch.bool"):
        RouteMap(T, K, E, **{**parts, "dest_row": rm.dest_row.bool()})
    with pytest.raises(ValueError, match=r"RouteMap tensors are on different devices \(.*sort_order=meta"):
        RouteMap(T, K, E, **{**parts, "sort_order": rm.sort_order.to("meta")})
    # integers of other kinds are fine, and stored as plain ints
    rm2 = RouteMap(torch.tensor(T), K, E, **parts)
    assert type(rm2.num_tokens) is int and rm2.num_tokens == T


def test_package_ships_py_typed():
    assert importlib.resources.files("moe_kernels").joinpath("py.typed").is_file()


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float8_e4m3fn])
def test_experts_refuse_rows_they_cannot_compute_in_by_dtype(dtype):
    rm = _map()
    x = torch.randn(T, D).to(dtype)
    w1, w2 = torch.ones(E, D, 2 * H).to(dtype), torch.ones(E, H, D).to(dtype)
    match = rf"the expert rows are {dtype}: the SwiGLU experts compute in torch.float16, .*torch.float64"
    with pytest.raises(ValueError, match=match):
        moe_ffn(x, rm, torch.rand(T, K), w1, w2)
    with pytest.raises(ValueError, match=match):
        swiglu_experts(x.repeat_interleave(K, 0), w1, w2, rm.offsets)
