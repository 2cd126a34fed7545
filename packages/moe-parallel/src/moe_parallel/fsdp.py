"""The FSDP2 baseline: torch's fully_shard with full resharding after forward (the "old stack").

Every weight is sharded over data parallelism and all-gathered before each use, in forward and
again in backward, on every micro-batch: the capacity tax this stack avoids. Kept for the
old-versus-new comparison. Runs on CPU with gloo (torch >= 2.11) and on GPU with NCCL.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch import nn


def apply_fsdp(model: nn.Module, group: dist.ProcessGroup, device_type: str) -> nn.Module:
    """Shard `model` over `group`: one FSDP unit per child of every nn.ModuleList (the blocks), plus the root.

    reshard_after_forward=True everywhere (ZeRO-3 style). The returned module is `model`, now
    holding DTensor parameters; gradient sync across micro-batches is controlled with
    `model.set_requires_gradient_sync(last_micro_batch)`.
    """
    # imported here: torch.distributed.fsdp costs ~3 s to import, and every rank imports moe_parallel
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    # torch's DTensor caches (sharding propagation, redistribute planners, mesh topology) keep every mesh an op
    # saw until the process exits, and the mesh holds its group in _pg_registry (torch 2.15; read only under
    # torch.compile, eager ops resolve the group by name): the group outlived destroy_process_group, and its gloo
    # threads ran into interpreter exit (pytorch#190489 aborts the rank there). Held weakly, it lives as long as
    # the run holds it (test_qa65).
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        mesh._pg_registry = weakref.WeakValueDictionary(registry)
    for module in reversed(list(model.modules())):  # inner lists first: fully_shard takes children before parents
        if isinstance(module, nn.ModuleList):
            for child in module:
                fully_shard(child, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model
