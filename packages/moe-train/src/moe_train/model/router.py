"""Top-k router: fp32 logits, softmax or sigmoid gating, balancing losses and health statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_kernels.triton import at_own_dtype
from moe_train.config import ConfigError, ModelConfig, RouterConfig, validate_model
from moe_train.model.layers import fp32_or_wider


# The scalar health sums a router keeps beside its per-expert load and probability sums (see take_stats).
STAT_SCALARS = ("tokens", "margin", "lb", "z", "calls", "dropped")
_DROPPED = STAT_SCALARS.index("dropped")  # the last: counted by the MoE layer after dispatch, not in forward


def refuse_a_router_the_loss_cannot_train(m: ModelConfig) -> None:
    """top_k=1 with normalize_top_k: the one selected weight divided by itself is exactly 1, so the language-model
    loss sends the router no gradient and only the balancing losses move it (Megatron-Core refuses the same: a
    softmax after a top-1). A model with these fields still loads, runs and exports; training one is refused."""
    r = m.router
    if m.num_experts > 0 and r.routing == "learned" and r.top_k == 1 and r.normalize_top_k:
        raise ConfigError("model.router.normalize_top_k=true with model.router.top_k=1: the one selected weight "
                          "renormalises to exactly 1, so the loss gives the router no gradient (only its balancing "
                          "losses would train it); set model.router.normalize_top_k=false (the expert's output is "
                          "scaled by its routing probability, as Switch Transformer and DeepSeek's gate do at top-1), "
                          "or model.router.top_k >= 2")


@dataclass
class RouterOutput:
    """expert_ids: [T, k] int64; weights: [T, k] fp32 (float64 for float64 rows); aux_loss: weighted lb + z loss
    (scalar)."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    aux_loss: torch.Tensor


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig):
        super().__init__()
        # checked as a run's router is (topk would fail at the first forward, an unknown gating compute sigmoid)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ConfigError(f"Router: num_experts={num_experts!r}: expected an integer >= 1")
        validate_model(ModelConfig(num_experts=num_experts, router=cfg))
        self.cfg = cfg
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # The aux-loss-free bias shifts selection only, never the weights; it is state, so it is saved.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=cfg.expert_bias)
        # Rows routed to each expert since the last bias update (the balancing signal).
        self.register_buffer("step_load", torch.zeros(num_experts), persistent=False)
        # Health sums of the training forwards since the last `take_stats()`; all detached, all on device.
        self.register_buffer("stat_load", torch.zeros(num_experts), persistent=False)
        self.register_buffer("stat_prob", torch.zeros(num_experts), persistent=False)
        self.register_buffer("stat_scalars", torch.zeros(len(STAT_SCALARS)), persistent=False)
        # Process group over which "global" balancing-loss counts are summed (set by the parallel runtime).
        self.lb_group: dist.ProcessGroup | None = None
        # True while activation checkpointing reruns this forward in backward (model/recompute.py): the
        # forward it repeats recorded the statistics and the balancing signal already.
        self.recomputing = False

    def _select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        routing = self.cfg.routing
        t = scores.shape[0]
        if routing == "learned":
            return scores.topk(k, dim=-1).indices
        if routing == "random":
            return torch.rand(t, self.num_experts, device=scores.device).topk(k, dim=-1).indices
        flat = torch.arange(t * k, device=scores.device) % self.num_experts  # uniform: exactly balanced
        return flat.view(t, k)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: [T, d] -> ids [T, k], weights [T, k] fp32, aux loss."""
        cfg, e, k = self.cfg, self.num_experts, self.cfg.top_k
        wide = fp32_or_wider(x.dtype)  # float64 rows keep float64
        with at_own_dtype(x):  # fp32 under autocast too: bf16 logits would change the top-k and the losses
            logits = F.linear(x.to(wide), self.weight.to(wide))
        probs = logits.softmax(-1) if cfg.gating == "softmax" else logits.sigmoid()
        scores = probs.detach() + self.expert_bias if cfg.expert_bias else probs.detach()
        ids = self._select(scores, k)
        weights = probs.gather(1, ids)
        if cfg.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if cfg.routed_scaling_factor != 1.0:  # skipped at 1.0: today's weights, bit for bit, and no extra graph node
            weights = weights * cfg.routed_scaling_factor

        counts = torch.zeros(e, device=x.device, dtype=wide)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device, dtype=wide))
        # P_e: mean routing probability; sigmoid scores are normalised per token to be comparable with f_e.
        p = probs if cfg.gating == "softmax" else probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        p_mean = p.mean(0)
        f = counts / ids.numel()
        if cfg.lb_loss_scope == "global" and self.lb_group is not None and dist.is_initialized():
            f_global = counts.clone()
            dist.all_reduce(f_global, group=self.lb_group)
            f = f_global / f_global.sum().clamp_min(1)
        lb = e * (f * p_mean).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        aux = cfg.lb_loss_weight * lb + cfg.z_loss_weight * z

        if not self.training or self.recomputing:
            return RouterOutput(ids, weights, aux)
        with torch.no_grad():
            self.step_load += counts
            self.stat_load += counts
            self.stat_prob += p.sum(0)
            if k < e:
                top = scores.topk(k + 1, dim=-1).values
                margin = (top[:, k - 1] - top[:, k]).sum()
            else:
                margin = torch.zeros((), device=x.device)
            self.stat_scalars[:_DROPPED] += torch.stack(  # tokens, margin, lb, z, calls
                [torch.tensor(float(x.shape[0]), device=x.device), margin, lb.detach(), z.detach(),
                 torch.ones((), device=x.device)]
            )
        return RouterOutput(ids, weights, aux)

    @torch.no_grad()
    def record_dropped(self, rows: torch.Tensor) -> None:
        """rows: 0-dim count of this layer's rows a capacity limit dropped in one training forward (kept on device)."""
        if self.training and not self.recomputing:
            self.stat_scalars[_DROPPED] += rows

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor | None = None) -> None:
        """Nudge under-loaded experts up and over-loaded ones down (aux-loss-free balancing).

        load: [E] rows per expert over the step (already summed across ranks); defaults to step_load.
        """
        load = self.step_load if load is None else load
        if self.cfg.expert_bias:
            self.expert_bias += self.cfg.expert_bias_rate * torch.sign(load.mean() - load)
        self.step_load.zero_()

    @torch.no_grad()
    def take_stats(self) -> torch.Tensor:
        """The health sums since the last call, then zeroed: [2E + 6] fp32 = rows routed to each expert [E],
        routing probability summed per expert [E], then STAT_SCALARS (tokens, top-k margin sum, lb and z loss
        summed over forwards, forwards, dropped rows). Sums, so one rank's add up with the others' (all-reduce)."""
        out = torch.cat([self.stat_load, self.stat_prob, self.stat_scalars])
        self.stat_load.zero_()
        self.stat_prob.zero_()
        self.stat_scalars.zero_()
        return out

    def health(self, stats: torch.Tensor) -> dict[str, float | list[float]]:
        """Router health from take_stats() sums (one rank's, or summed over ranks): everything from one scope,
        the tokens those sums cover. {} when they cover none."""
        e = self.num_experts
        stats = stats.detach().double().cpu()
        load, prob = stats[:e], stats[e : 2 * e]
        tokens, margin, lb, z, calls, dropped = stats[2 * e :].tolist()
        if tokens == 0:
            return {}
        f = load / load.sum().clamp_min(1)
        p = prob / tokens
        rows = float(load.sum())  # tokens x top_k
        return {
            "tokens": int(tokens),
            "f": [round(v, 5) for v in f.tolist()],
            "P": [round(v, 5) for v in p.tolist()],
            "max_over_mean_load": float(load.max() / load.mean().clamp_min(1e-20)),
            "dead_experts": int((load == 0).sum()),
            "topk_margin": margin / tokens,
            "lb_loss": lb / calls,
            "z_loss": z / calls,
            "dropped_rows": int(round(dropped)),
            "dropped_fraction": dropped / rows if rows else 0.0,
        }

    def pop_health(self) -> dict[str, float | list[float]]:
        """This process's router health since the last call (see health); the trainer reduces over ranks first."""
        return self.health(self.take_stats())
