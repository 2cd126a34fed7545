"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

Trainer._update_expert_bias must move the bias by the load summed over every rank (one all-reduce), not this
rank's own load. test_qa82 checks the real 2-rank run, but there each rank's sign(mean - load) pattern happened to
equal the global one at every step (sign() is scale invariant), so dropping the all-reduce passed it. Here the other
ranks' load flips the signs."""

from types import SimpleNamespace

import torch

from moe_train.config import RouterConfig
from moe_train.model.router import Router
from moe_train.trainer.loop import Trainer


def test_the_bias_follows_the_load_summed_over_ranks_not_this_ranks_own():
    r = Router(8, 4, RouterConfig(expert_bias=True, expert_bias_rate=0.5))
    r.step_load.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # this rank: expert 0 over-loaded
    other_ranks = torch.tensor([[0.0, 30.0, 30.0, 0.0]])  # the rest of the job: experts 1 and 2 far more
    reduced = []

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        reduced.append(t.clone())
        return t + other_ranks

    fake = SimpleNamespace(model=SimpleNamespace(routers=lambda: [(0, r)]),
                           runtime=SimpleNamespace(all_reduce_sum=all_reduce_sum))
    Trainer._update_expert_bias(fake)
    assert len(reduced) == 1  # one collective
    total = torch.tensor([10.0, 30.0, 30.0, 0.0])
    torch.testing.assert_close(r.expert_bias, 0.5 * torch.sign(total.mean() - total))  # [+, -, -, +]
    assert torch.all(r.step_load == 0)
