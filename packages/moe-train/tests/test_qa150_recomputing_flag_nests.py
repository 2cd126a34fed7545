"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

_Recomputing is documented re-enterable (autograd may rerun a part inside another rerun): leaving the inner one
must restore the flag the outer one set, not clear it, or the outer rerun's remaining router forwards would count
their load (expert-bias signal, health stats) a second time. Clearing it on exit passed every test."""

from torch import nn

from moe_train.config import RouterConfig
from moe_train.model.recompute import _Recomputing
from moe_train.model.router import Router


def test_leaving_a_nested_rerun_keeps_the_outer_one_marked():
    owner = nn.Sequential(Router(8, 4, RouterConfig()), Router(8, 4, RouterConfig()))
    outer, inner = _Recomputing(owner), _Recomputing(owner)
    assert not any(r.recomputing for r in owner)
    with outer:
        with inner:
            assert all(r.recomputing for r in owner)
        assert all(r.recomputing for r in owner)  # still inside the outer rerun
    assert not any(r.recomputing for r in owner)
