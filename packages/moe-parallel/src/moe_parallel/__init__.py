"""moe-parallel: parallel layout and groups, resident-weight DDP, ZeRO-1 AdamW, expert parallelism, FSDP2 baseline."""

from moe_parallel.buffers import FlatParams
from moe_parallel.ddp import GradientSync
from moe_parallel.expert_parallel import ExpertShard, apply_expert_parallel, expert_parameter_names, moe_layers
from moe_parallel.fsdp import apply_fsdp
from moe_parallel.groups import ParallelGroups, build_groups
from moe_parallel.layout import ParallelLayout, RankCoords
from moe_parallel.module_state import broadcast_module_state
from moe_parallel.optimizer import AdamWConfig, DistributedAdamW, OptimizerStepResult
from moe_parallel.optimizer_state import OptimizerStatePiece

__version__ = "0.13.9"

__all__ = [
    "ParallelLayout",
    "RankCoords",
    "ParallelGroups",
    "build_groups",
    "FlatParams",
    "broadcast_module_state",
    "GradientSync",
    "AdamWConfig",
    "DistributedAdamW",
    "OptimizerStepResult",
    "OptimizerStatePiece",
    "apply_expert_parallel",
    "expert_parameter_names",
    "moe_layers",
    "ExpertShard",
    "apply_fsdp",
]
