"""QA 131: AllToAllDispatcher.dispatch names a route map that is not a RouteMap (the expert ids it is built from), as
LocalDispatcher.dispatch, permute and combine do. Before: "AttributeError: 'Tensor' object has no attribute
'num_experts'", naming neither the argument nor build_route_map."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import kernels_spawn

# One gloo process of world 1 (its own interpreter: no process group is left in the test process).
CHECK = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from moe_kernels import AllToAllDispatcher, LocalDispatcher, build_route_map

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    ids, x, out = torch.tensor([[0, 1], [1, 2], [2, 0]]), torch.randn(3, 4), {}
    for name, dispatcher in (("all_to_all", AllToAllDispatcher(dist.group.WORLD, 3)), ("local", LocalDispatcher(3))):
        try:
            dispatcher.dispatch(x, ids)
            out[name] = "accepted"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    result = AllToAllDispatcher(dist.group.WORLD, 3).dispatch(x, build_route_map(ids, 3))
    out["good_rows"] = list(result.rows.shape)
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_all_to_all_dispatch_names_expert_ids_given_for_the_route_map():
    port = kernels_spawn.free_port()  # not a port-0 pick another process could take meanwhile
    proc = subprocess.run([sys.executable, "-c", CHECK, str(port)], capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = "TypeError: route_map must be a RouteMap (build_route_map(expert_ids, num_experts)), got Tensor"
    assert out["local"] == want
    assert out["all_to_all"] == want
    assert out["good_rows"] == [6, 4]
