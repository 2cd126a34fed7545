"""QA 147: review helper 155's findings on the Hugging Face bridge and inspect (the import-side ones are in
test_qa94.py: both weight layouts in one folder, token ids past the vocabulary).

- A write failure that names no file (a full disk, a file-size limit: safetensors' "I/O error: File too large")
  ended `moe-train import-hf` / `export-hf` in a 30-line traceback whose last line named neither file nor folder.
  Now one line naming the target folder, exit status 1, the target as it was and no partial folder left.
- `moe-train inspect` of a damaged checkpoint printed its DAMAGED line fifth (after the header lines, where `| head`
  hid it) and exited 0. Now the line comes first and the exit status is 1.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ckpt import ShardSpec, save_checkpoint
from moe_train.cli import main

transformers = pytest.importorskip("transformers")


def _tiny_llama(folder: Path) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def _file_size_limit(limit: int):  # noqa: ANN202
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("first_too_large", ["model.safetensors", "tokenizer.json"])
def test_a_write_failure_on_a_full_disk_is_one_line_naming_the_folder(tmp_path, first_too_large):
    """model.safetensors: safetensors' error names no file. tokenizer.json (copied first): shutil.copyfile's names
    the source tokenizer, and went through as a traceback until moe-ckpt 0.21.9 (review helper 157)."""
    source = _tiny_llama(tmp_path / "hf")
    assert (source / "model.safetensors").stat().st_size > 300_000
    if first_too_large == "tokenizer.json":  # copied as it is, before the weights are written
        (source / "tokenizer.json").write_text('{"padding": "' + "a" * 200_000 + '"}')
    out = tmp_path / "imported"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "moe_train", "import-hf", str(source), str(out)], env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(64 * 1024))
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moe-train: error: the import into {str(out)!r} stopped on "), lines
    assert "File too large" in lines[0] and "is as it was" in lines[0], lines[0]
    assert ("SafetensorError" if first_too_large == "model.safetensors" else "OSError") in lines[0], lines[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial folder left


def test_inspect_of_a_damaged_checkpoint_says_so_first_and_exits_1(tmp_path, capsys):
    ckpt = tmp_path / "step-00000001"
    save_checkpoint(ckpt, [ShardSpec("w", (4,), torch.arange(4.0), writer=True)], {"step": 1}, 0, 1, None)
    assert main(["inspect", str(ckpt)]) == 0
    capsys.readouterr()
    (shard,) = ckpt.glob("shard-*.safetensors")
    shard.unlink()
    assert main(["inspect", str(ckpt)]) == 1
    assert capsys.readouterr().out.startswith(f"DAMAGED: {shard.name} (rank 0) is missing")
