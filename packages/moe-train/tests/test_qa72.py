"""QA 72: the README's shell commands typed as a newcomer would, in a fresh folder, on a 2-core CPU machine.

One flow breaks: a run of the tiny preset exported with `export-hf`, brought back with `import-hf`, and started
from with `train --config OUT/config.json --train.init_from=OUT` (the root README's sentence and moe-train
README's `import-hf hf/e16 imported/e16` line) is refused before the first step, because the imported
config.json pairs the model's vocab_size (2,048, the tiny preset's) with Config()'s data.default_vocab_size
(4,096), which the embedded corpus check refuses.
"""

from __future__ import annotations

import dataclasses
import json

from moe_ckpt.hf import export_hf_folder
from moe_train.cli import main
from moe_train.config_io import build_config
from moe_train.model import Transformer


def test_import_hf_output_of_a_tiny_run_starts_a_run_as_the_readme_says(tmp_path, monkeypatch, capsys):
    """README.md:36-38: "`moe-train import-hf HF_FOLDER OUT` converts a Hugging Face Qwen2-MoE / Qwen3-MoE /
    GLM-4-MoE / Qwen3 / Llama folder to ours, and `moe-train train --config OUT/config.json
    --train.init_from=OUT` starts a run from its weights"; packages/moe-train/README.md:14:
    "uv run moe-train import-hf hf/e16 imported/e16  # back to our names (train --train.init_from starts from it)".

    Typed after README line 8's `export-hf runs/e16 hf/e16` (runs/e16 = the tiny preset with 16 experts), the user
    sees, exit status 2, no step trained:
    `moe-train: error: data.default_vocab_size=4096: expected <= model.vocab_size=2048 (the embedded corpus's BPE
    emits ids the model must embed); set data.default_vocab_size=2048 or raise model.vocab_size`.
    import-hf wrote config.json with the model's vocab_size 2048 beside data.default_vocab_size 4096 (Config()'s
    default, not the tiny preset's 2048 that trained the model), a config that train itself refuses.

    (hf/e16 is built here straight from the tiny model's state_dict, as `export-hf` writes it, to skip a training
    run; the CLI flow `train ... --train.run_dir=runs/e16` / `export-hf` / `import-hf` / `train --config` fails
    the same way. `--data.default_max_bytes` only keeps the corpus small once the command works.)
    """
    monkeypatch.chdir(tmp_path)
    cfg = build_config("tiny", overrides={"model.num_experts": 16})
    export_hf_folder(dataclasses.asdict(cfg.model), Transformer(cfg.model).state_dict(), tmp_path / "hf" / "e16")

    assert main(["import-hf", "hf/e16", "imported/e16"]) == 0
    written = json.loads((tmp_path / "imported" / "e16" / "config.json").read_text())
    assert written["model"]["vocab_size"] == 2048
    capsys.readouterr()

    rc = main(["train", "--config", "imported/e16/config.json", "--train.init_from=imported/e16",
               "--train.steps=1", "--train.eval_interval=0", "--train.progress=false",
               "--data.default_max_bytes=200000"])
    err = capsys.readouterr().err
    assert rc == 0, f"train --config OUT/config.json --train.init_from=OUT was refused (exit {rc}): {err.strip()}"
    start = json.loads((tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["init_from"] == "imported/e16"
