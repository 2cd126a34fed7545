"""The package READMEs' ```python blocks, run as a newcomer would (QA 55).

Every block of every packages/*/README.md is listed in BLOCKS, by README and first line, so a new or rewritten
block fails `test_every_readme_block_is_classified` until it is classified here:
  - "run": executed on the CPU, its API calls exactly as written. A prelude may define what the README leaves to
    the reader (a model, a config) and the test may shrink the run (steps, data) through `build_config`; the
    block's own lines are not edited.
  - "raises: Exc": executed, and its last statement must raise Exc (a block that shows an error).
  - "multi-rank: why": needs torchrun ranks, so not run here: test_qa112_readme_ranks.py runs it on 4 or 8 gloo
    ranks. Here such a block is still parsed, every name it imports must exist, and every save must go to its own
    folder.
Every block, whatever its kind, must parse and import only names that exist.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
READMES = sorted((ROOT / "packages").glob("*/README.md"))

# (package, first line of the block) -> kind
BLOCKS = {
    ("moe-kernels", "import torch"): "run",  # both moe-kernels blocks start with it; the second picks cpu itself
    ("moe-precision", "import torch"): "raises: NotImplementedError",  # its last line: PrecisionRecipe("mxfp8")
    ("moe-train", "from moe_train import build_config, Transformer, count_params"): "run",
    ("moe-train", "import torch"): "run",  # the sliding-window model
    ("moe-parallel", "import torch.distributed as dist"):
        "multi-rank: ParallelLayout(dp=4, ep=2), torchrun x4; run by test_qa112_readme_ranks.py",
    # the optimizer of the block above, with write / read left to the reader: test_qa112_readme_ranks.py runs it
    # on that block's 4 ranks; the same sequence runs in moe-parallel's tests/test_optimizer_state_pieces.py
    # (4 gloo ranks, restored at dp=2)
    ("moe-parallel", "for p in opt.state_pieces():              # save: each element once, by the rank that owns it"):
        "multi-rank: the ParallelLayout block's optimizer, torchrun x4; run by test_qa112_readme_ranks.py",
    ("moe-ckpt", "from datetime import timedelta"):
        "multi-rank: Box.dim0 over 8 EP ranks, torchrun x8; run by test_qa112_readme_ranks.py",
    ("moe-ckpt", "from moe_ckpt.hf import export_hf_folder, open_hf_folder"): "run",
}


def readme_blocks():
    out = []
    for readme in READMES:
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", readme.read_text(), re.S)):
            out.append(pytest.param(readme.parent.name, m.group(1), id=f"{readme.parent.name}-{i}"))
    return out


def kind_of(pkg, code):
    return BLOCKS.get((pkg, code.splitlines()[0].strip()))


def test_every_readme_block_is_classified():
    blocks = readme_blocks()
    assert len(blocks) >= 6, [b.id for b in blocks]
    unknown = [b.id for b in blocks if kind_of(*b.values) is None]
    assert not unknown, f"README python blocks not classified in BLOCKS: {unknown}"


@pytest.mark.parametrize("pkg,code", readme_blocks())
def test_block_parses_and_imports_exist(pkg, code):
    import importlib

    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(mod, a.name)]
            assert not missing, f"{pkg} README imports {missing} from {node.module}, which has no such name"
        elif isinstance(node, ast.Import):
            for a in node.names:
                importlib.import_module(a.name)


@pytest.mark.parametrize("pkg,code", readme_blocks())
def test_block_saves_each_checkpoint_to_its_own_folder(pkg, code):
    # a step's folder is written once (a second save there raises FileExistsError): the moe-ckpt block saved
    # step_dir("run", step) twice, once sync and once async, so it failed when run as written
    targets = [ast.unparse(n.args[0]) for n in ast.walk(ast.parse(code))
               if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
               and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in ("save", "save_checkpoint")
               and n.args]
    assert len(targets) == len(set(targets)), f"{pkg} README saves twice to one folder: {targets}"


@pytest.fixture
def small_build_config(monkeypatch, data_dir):
    """build_config as the README calls it, then shrunk to a few steps on the small test data folder."""
    import moe_train
    from moe_train import config_io

    real = config_io.build_config

    def build_config(preset=None, yaml_path=None, overrides=None):
        cfg = real(preset, yaml_path, overrides)  # the README's call, validated as written
        return real(preset, yaml_path, {**(overrides or {}), "model.vocab_size": 512, "data.path": str(data_dir),
                                        "data.seq_len": 32, "train.steps": 2, "train.micro_batch_size": 2,
                                        "train.warmup_steps": 1, "train.eval_interval": 2, "train.eval_windows": 2,
                                        "train.progress": False, "model.num_experts": cfg.model.num_experts})

    monkeypatch.setattr(moe_train, "build_config", build_config)
    return build_config


@pytest.mark.parametrize("pkg,code", readme_blocks())
def test_block_runs_on_cpu(pkg, code, tmp_path, monkeypatch, request):
    kind = kind_of(pkg, code)
    if kind is None or kind.startswith("multi-rank"):
        pytest.skip(f"{pkg}: {kind}")
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__readme__"}
    if pkg == "moe-train":
        request.getfixturevalue("small_build_config")
    if pkg == "moe-ckpt":  # the HF block: a tiny model, and a data/tokenizer.json in the working folder
        request.getfixturevalue("data_dir")  # tmp_path/data, with its tokenizer.json
        exec("from moe_train import build_config, Transformer\ncfg = build_config('tiny')\n"
             "model = Transformer(cfg.model)", ns)
    if kind.startswith("raises: "):
        exc = kind.removeprefix("raises: ")
        tree = ast.parse(code)
        body, last = ast.Module(tree.body[:-1], []), ast.Module(tree.body[-1:], [])
        exec(compile(body, f"<{pkg} README>", "exec"), ns)
        with pytest.raises(Exception) as info:
            exec(compile(last, f"<{pkg} README, last line>", "exec"), ns)
        assert type(info.value).__name__ == exc
    else:
        exec(compile(code, f"<{pkg} README>", "exec"), ns)
    if pkg == "moe-train" and "sliding_window_pattern" in code:  # the sliding-window model: a forward
        assert ns["logits"].shape == (2, 64, 256) and ns["model"].cfg.attention_window(3) == 0
    elif pkg == "moe-train":
        assert (tmp_path / "runs/e16-api/metrics.jsonl").exists()
        assert list((tmp_path / "runs/e16-api/checkpoints").glob("step-*"))
    if pkg == "moe-ckpt":
        assert (tmp_path / "out/hf/config.json").exists() and (tmp_path / "out/hf/tokenizer.json").exists()
