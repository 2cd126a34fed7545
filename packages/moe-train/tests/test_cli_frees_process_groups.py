"""`moe-train train` returns with no gloo process group alive, also when it refuses a run after its process group
exists: a group left for interpreter exit can abort the process from a gloo worker thread (pytorch#190489).

The command runs in a child process with the garbage collector off, as if no automatic collection had happened
between the error and exit: what is still alive when main() returns is what exit would have to free."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, json, os, sys
    gc.disable()
    from moe_train.cli import main
    from moe_train.data import prepare_data, stdlib_documents

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return len([n for n in names if n.startswith(("pt_gloo", "gloo"))])

    root = sys.argv[1]
    prepare_data(list(stdlib_documents(60_000)), f"{root}/data", vocab_size=512, source="test")
    train = ["train", "--preset", "tiny", f"--data.path={root}/data", f"--train.run_dir={root}/run",
             "--train.steps=1", "--train.warmup_steps=1", "--train.device=cpu", "--train.progress=false",
             "--train.save_interval=0", "--train.eval_interval=0", "--model.vocab_size=512", "--model.num_layers=2",
             "--model.d_model=64", "--data.seq_len=32", "--train.micro_batch_size=2",
             "--parallel.expert_capacity_factor=2.0"]  # not a plain run: the distributed runtime, on gloo
    done = main(train)
    after_done = gloo_threads()
    refused = main(train)  # the folder holds a completed run without a checkpoint: refused, after init
    print(json.dumps({"done": done, "after_done": after_done, "refused": refused, "after_refused": gloo_threads()}))
""")


def test_train_leaves_no_gloo_group_alive_when_it_returns(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["done"] == 0 and got["refused"] == 2, (got, out.stderr)
    assert "holds a completed run" in out.stderr, out.stderr
    assert got["after_done"] == 0, got
    assert got["after_refused"] == 0, f"{got['after_refused']} gloo threads alive after a refused run returned"
