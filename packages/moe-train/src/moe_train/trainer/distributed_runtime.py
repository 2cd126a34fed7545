"""The distributed Runtime: expert parallelism, resident-weight DDP and the ZeRO-1 optimizer.

Parallelism is applied to the plain model from outside (moe_parallel); the loop sees the same
calls as LocalRuntime. strategy="fsdp" swaps in the FSDP2 baseline (torch AdamW on DTensors).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    ExpertShard,
    FlatParams,
    GradientSync,
    ParallelGroups,
    apply_expert_parallel,
    apply_fsdp,
    expert_parameter_names,
    moe_layers,
)
from moe_train.config import Config
from moe_train.trainer.runtime import (
    CheckpointShard,
    FlatRange,
    Slice,
    StepResult,
    is_meta,
    materialize,
    set_training_choices,
)
from moe_train.trainer.schedule import param_groups


class DistributedRuntime:
    """Runtime over process groups already built (see launch.make_runtime).

    param_dtype: dtype of the model's resident weights (e.g. torch.bfloat16 on GPU); None keeps
    the model's own (fp32). The fp32 masters live in the optimizer either way.
    """

    def __init__(self, cfg: Config, device: torch.device, groups: ParallelGroups,
                 param_dtype: torch.dtype | None = None, overlap: bool = True, owns_world: bool = True):
        self.cfg = cfg
        # owns_world=False: the default process group is the caller's (initialised before make_runtime), so close()
        # destroys only the groups this runtime's run made and leaves the caller's world working
        self.owns_world = owns_world
        self.made_groups = [g for g in (groups.dp, groups.ep, groups.edp, groups.pp, groups.dp_forward, groups.world)
                            if g is not None]
        self.device = device
        self.groups = groups
        self.param_dtype = param_dtype
        self.overlap = overlap
        c = groups.coords
        self.rank, self.world_size = c.rank, groups.layout.world_size
        self.dp_rank, self.dp_size = c.dp_rank, groups.layout.dp
        self.model: nn.Module | None = None
        self.expert_shards: dict[str, ExpertShard] = {}
        self.sync: GradientSync | None = None
        self.optimizer: DistributedAdamW | None = None
        self.torch_optimizer: torch.optim.AdamW | None = None  # fsdp baseline only

    # ---- setup ---------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        p, t = self.cfg.parallel, self.cfg.train
        meta = is_meta(model)
        set_training_choices(model, self.cfg)  # every rank recomputes and compiles the same parts
        if p.strategy == "fsdp":
            model = materialize(model, self.device, t.seed) if meta else model.to(self.device)
            self._cast(model)
            self.model = model
            return self._setup_fsdp(model)
        if not meta:
            model = model.to(self.device)
        # on a meta model this slices shapes only: the rank allocates just its own experts below
        self.expert_shards = apply_expert_parallel(model, self.groups, p.expert_capacity_factor)
        if meta:
            materialize(model, self.device, t.seed, {n: s.row_offset for n, s in self.expert_shards.items()})
            # to_empty made new parameters, without apply_expert_parallel's mark: FlatParams (which refuses other
            # experts in one group) and the optimizer's state_pieces() (global offsets) read it
            for name, q in model.named_parameters():
                if name in self.expert_shards and self.groups.layout.ep > 1:
                    q.expert_shard = self.expert_shards[name]
        self._cast(model)
        self.model = model
        expert_names = expert_parameter_names(model)
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        grad_dtype = torch.float32 if p.fp32_grad_accum else None
        flats = [FlatParams([(n, q) for n, q in named if n not in expert_names], self.groups.dp,
                            p.distributed_optimizer, grad_dtype)]
        experts = [(n, q) for n, q in named if n in expert_names]
        if experts:
            flats.append(FlatParams(experts, self.groups.edp, p.distributed_optimizer, grad_dtype))
        self.sync = GradientSync(flats, divisor=self.dp_size, overlap=self.overlap)
        self.optimizer = DistributedAdamW(
            flats, AdamWConfig(t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay, t.grad_clip), self.groups.world
        )
        return model

    def _cast(self, model: nn.Module) -> None:
        if self.param_dtype is not None:
            for param in model.parameters():
                param.data = param.data.to(self.param_dtype)

    def _setup_fsdp(self, model: nn.Module) -> nn.Module:
        if self.groups.layout.ep != 1:
            raise ValueError(f"parallel.strategy='fsdp' is the dense-sharding baseline: expected ep=1, got ep={self.groups.layout.ep}")
        for _, layer in moe_layers(model):
            # not FSDP's own dp group when there is another: a checkpoint recompute re-runs it during backward
            layer.router.lb_group = self.groups.forward_group
        apply_fsdp(model, self.groups.dp, self.device.type)
        if getattr(model, "loss_chunk_tokens", 0):
            # the chunked Transformer.loss_terms (which loss calls) runs the model's parts itself (the head's GEMM
            # needs its weight): FSDP2 gathers the root's parameters for it as it does for forward
            from torch.distributed.fsdp import register_fsdp_forward_method
            register_fsdp_forward_method(model, "loss_terms")
        t = self.cfg.train
        self.torch_optimizer = torch.optim.AdamW(
            param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
        )
        return model

    # ---- one optimizer step ----------------------------------------------------------------
    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """loss: this rank's micro-batch loss, already divided by grad_accum."""
        if self.torch_optimizer is not None:
            self.model.set_requires_gradient_sync(last_micro_batch)
            loss.backward()
            return
        self.sync.begin_backward(last_micro_batch)
        loss.backward()
        if last_micro_batch:
            self.sync.finish()

    def step(self, lr: float) -> StepResult:
        if self.torch_optimizer is not None:
            return self._step_fsdp(lr)
        result = self.optimizer.step(lr)
        self.sync.zero_grads()
        return StepResult(result.grad_norm, result.skipped)

    def discard_gradients(self) -> None:
        if self.torch_optimizer is not None:
            self.torch_optimizer.zero_grad(set_to_none=True)
        else:
            self.sync.zero_grads()

    def _step_fsdp(self, lr: float) -> StepResult:
        params = [q for q in self.model.parameters() if q.grad is not None]
        clip = self.cfg.train.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            for group in self.torch_optimizer.param_groups:
                group["lr"] = lr
            self.torch_optimizer.step()
        self.torch_optimizer.zero_grad(set_to_none=True)
        return StepResult(float(norm), skipped)

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps if self.optimizer is not None else 0

    # ---- collectives for the loop ----------------------------------------------------------
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over every rank, in place (metrics, expert-bias load); returns t."""
        dist.all_reduce(t, group=self.groups.world)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.groups.world)

    def background_barrier(self) -> Callable[[], None]:
        """A gloo group of its own (call on every rank, in the same order): the async checkpoint writer's
        barriers run on a background thread. Its timeout is the collective timeout, not torch's 30-minute
        default, so a save whose peer is gone fails as soon as a training collective would."""
        timeout = timedelta(seconds=self.cfg.parallel.collective_timeout_s)
        group = dist.new_group(backend="gloo", timeout=timeout)
        self.made_groups.append(group)
        return lambda: dist.barrier(group=group)

    # ---- state -----------------------------------------------------------------------------
    def checkpoint_shards(self) -> list[CheckpointShard]:
        """Model weights and optimizer state this rank holds, with global names, shapes and slices.

        Weights: per-dim slices (experts: rows [ep_rank*E_local, +E_local) of [E, ...]), written by
        the first replica. Optimizer: f"optim.{name}.master" / ".exp_avg" / ".exp_avg_sq" as flat
        ranges of the flattened global tensor (one rank owns each element); f"optim.{name}.step" and
        "optim.step" (the same on every rank), written by rank 0.
        """
        if self.optimizer is None:
            raise NotImplementedError("checkpoint_shards needs strategy='ddp' (FSDP2 is a baseline only)")
        out: list[CheckpointShard] = []
        first_dense = self.groups.coords.dp_rank == 0
        first_expert = self.groups.coords.edp_rank == 0
        for name, q in self.model.named_parameters():
            shard = self.expert_shards.get(name)
            if shard is None:
                out.append(CheckpointShard(name, tuple(q.shape), tuple((0, n) for n in q.shape), q.data, first_dense))
            else:
                dims = ((shard.row_offset, q.shape[0]), *((0, n) for n in q.shape[1:]))
                out.append(CheckpointShard(name, shard.global_shape, dims, q.data, first_expert))
        for piece in self.optimizer.state_pieces():  # views into the optimizer's state: loading copies into them
            out.append(CheckpointShard(f"optim.{piece.name}.{piece.key}", piece.global_shape,
                                       FlatRange(piece.offset, piece.numel), piece.tensor, piece.owner))
        for name, n in self.optimizer.param_step_counts().items():
            out.append(CheckpointShard(f"optim.{name}.step", (), (), torch.tensor(float(n)), self.rank == 0))
        step = torch.tensor(float(self.optimizer.step_count))
        out.append(CheckpointShard("optim.step", (), (), step, self.rank == 0))
        return out

    @torch.no_grad()
    def load_checkpoint_shards(self, read_fn: Callable[[str, Slice], torch.Tensor]) -> None:
        """Fill weights and optimizer state from read_fn(global_name, slice) -> tensor of that slice."""
        steps = {f"optim.{name}.step": name for name in self.optimizer.param_step_counts()}
        counts: dict[str, int] = {}
        for s in self.checkpoint_shards():
            value = read_fn(s.global_name, s.slice)
            if s.global_name == "optim.step":
                self.optimizer.step_count = int(value.reshape(()).item())
            elif s.global_name in steps:
                counts[steps[s.global_name]] = int(value.reshape(()).item())
            else:
                s.tensor.copy_(value.reshape(s.tensor.shape))
        self.optimizer.load_param_step_counts(counts)  # after step_count, whose setter sets them all
        # the weights from the fp32 masters, not the stored weight copies: a bf16-resident run's are rounded, and
        # fp32 weights read from them would start this run off its masters
        self.optimizer.refresh_weights()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.remove_hooks()
        if dist.is_initialized() and self.owns_world:
            dist.destroy_process_group()
        elif dist.is_initialized():
            for group in {id(g): g for g in self.made_groups if g is not dist.group.WORLD}.values():
                dist.destroy_process_group(group)
