"""QA 87: the OLMo-core 3 journey from the command line, at tiny scale. `train --preset olmo3-bench-e8` shrunk by
overrides (its benchmark-mode random router said out loud), `export-hf --custom-code` (the printed AutoTokenizer
line loads without transformers' "run the custom code? [y/N]" prompt, and is not printed for a folder without a
tokenizer), `import-hf`, and `train --train.init_from=IMPORTED` on a data folder of another tokenizer (warned).
transformers' module cache is kept in a temporary folder."""

from __future__ import annotations

import builtins
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from moe_train.cli import main
from moe_train.config import Config, ConfigError, ModelConfig, validate
from moe_train.data import prepare_data, stdlib_documents
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home  # noqa: E402,F401 - fixture

# olmo3-bench-e8 (softmax, shared expert, per-head QK-norm, dense first layer) at a size that trains in well under 1 s
SHRINK = ["--model.d_model=32", "--model.num_layers=2", "--model.num_heads=4", "--model.num_kv_heads=2",
          "--model.dense_hidden=48", "--model.expert_hidden=16", "--model.shared_expert_hidden=16",
          "--model.vocab_size=320", "--data.seq_len=16", "--train.micro_batch_size=2", "--train.eval_windows=2",
          "--train.warmup_steps=1", "--train.progress=false", "--train.log_interval=1"]


pytestmark = pytest.mark.usefixtures("hf_home")  # transformers' caches in a temporary folder


def load_it_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("load it: ")]
    assert len(lines) == 1, out
    return lines[0]


def eval_losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def test_the_olmo3_preset_journey_says_what_a_user_needs_at_each_step(tmp_path, capsys, monkeypatch):
    """train (random routing warned, naming the fix) -> export-hf --custom-code (the printed AutoTokenizer call asks
    nothing) -> import-hf -> init_from: the run's last eval loss at step 0, and a data folder of another tokenizer
    warned about."""
    monkeypatch.chdir(tmp_path)
    docs = list(stdlib_documents(40_000))
    data = prepare_data(docs, tmp_path / "data", vocab_size=300, source="qa87")
    other = prepare_data(docs[: max(2, len(docs) // 2)], tmp_path / "other", vocab_size=290, source="qa87-other")

    common = ["train", "--preset", "olmo3-bench-e8", *SHRINK, "--train.steps=1"]
    assert main([*common, f"--data.path={data}", "--train.run_dir=bench"]) == 0
    err = capsys.readouterr().err
    assert "model.router.routing='random' (preset olmo3-bench-e8 sets it) is a benchmark mode" in err, err
    assert "--model.router.routing=learned" in err, err

    common.append("--model.router.routing=learned")
    assert main([*common, f"--data.path={data}", "--train.run_dir=run"]) == 0
    assert "benchmark mode" not in capsys.readouterr().err
    assert main(["export-hf", "run", "hf", "--custom-code", "--dtype", "fp32"]) == 0
    line = load_it_line(capsys.readouterr().out)
    assert "AutoTokenizer.from_pretrained('hf', trust_remote_code=True)" in line, line
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a, **k: asked.append(a) or "n")
    call = re.search(r"AutoTokenizer\.from_pretrained\((.*?)\)", line)[1]
    tok = eval(f"transformers.AutoTokenizer.from_pretrained({call})")  # the call exactly as printed
    assert asked == [] and tok("import os").input_ids

    assert main(["import-hf", "hf", "imported"]) == 0
    assert main([*common, f"--data.path={data}", "--train.init_from=imported", "--train.run_dir=from_hf"]) == 0
    assert "tokenized by another" not in capsys.readouterr().err  # the tokenizer the weights were trained with
    # fp32 export: the imported weights are the run's last ones, evaluated on the same windows
    assert eval_losses(Path("from_hf"))[0] == eval_losses(Path("run"))[-1]

    assert main([*common, f"--data.path={other}", "--train.init_from=imported", "--train.run_dir=other_data"]) == 0
    err = capsys.readouterr().err
    assert "train.init_from='imported' holds the tokenizer.json its weights were trained with" in err, err
    assert "prepare-data --tokenizer imported/tokenizer.json" in err, err


def test_an_export_without_a_tokenizer_prints_no_autotokenizer_call(tmp_path, capsys, monkeypatch):
    """A checkpoint of the embedded corpus exported away from its data folder ships no tokenizer.json: the load
    line must not tell the user to call AutoTokenizer on the folder (it fails there)."""
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)  # no data/ here: the export finds no tokenizer
    cfg = validate(Config(model=ModelConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                            dense_hidden=16, num_experts=2, expert_hidden=8)))
    (tmp_path / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()},
              str(tmp_path / "ckpt" / "model.safetensors"))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["export-hf", "ckpt", "hf", "--custom-code"]) == 0
    printed = capsys.readouterr()
    assert "no tokenizer found" in printed.err and not (tmp_path / "hf" / "tokenizer.json").exists()
    line = load_it_line(printed.out)
    assert "AutoTokenizer" not in line and "--tokenizer" in line, line


def test_an_odd_derived_head_dim_names_the_fields_it_comes_from():
    """Shrinking d_model under a preset's num_heads (olmo3: 32 heads) gives head_dim=1 without the user setting it:
    the refusal names d_model and num_heads."""
    cfg = Config(model=ModelConfig(d_model=32, num_heads=32, num_kv_heads=8))
    with pytest.raises(ConfigError, match=re.escape("model.head_dim=1: expected an even number (RoPE rotates pairs; "
                                                    "null: model.d_model=32 // model.num_heads=32)")):
        validate(cfg)
    with pytest.raises(ConfigError, match=re.escape("model.head_dim=5: expected an even number (RoPE rotates pairs)")):
        validate(Config(model=ModelConfig(d_model=40, num_heads=8, num_kv_heads=8, head_dim=5)))


def test_an_export_never_replaces_a_model_folder_it_did_not_write(tmp_path):
    """A folder of the names an export writes (config.json, model.safetensors, tokenizer files: a model downloaded
    from the Hub) was replaced whole by an export into it; now only a folder holding an export's marker is replaced.
    Before the fix the second export below succeeded and the downloaded model was gone."""
    from moe_ckpt.hf import HFConversionError
    from moe_train.hf_bridge import export_hf

    model = Transformer(validate(Config(model=ModelConfig(
        vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, dense_hidden=24, num_experts=2,
        expert_hidden=8))).model)
    downloaded = tmp_path / "Qwen3-30B-A3B"
    downloaded.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (downloaded / name).write_text(f"someone's {name}")
    with pytest.raises(HFConversionError, match=r"no export of ours wrote \(it has no \.moe_ckpt_export"):
        export_hf(model, downloaded, dtype="fp32")
    assert sorted(p.read_text() for p in downloaded.iterdir()) == [
        "someone's config.json", "someone's model.safetensors", "someone's tokenizer.json"]
    ours = tmp_path / "ours"
    export_hf(model, ours, dtype="fp32")
    export_hf(model, ours, dtype="bf16")  # an export of ours is still replaced
    assert json.loads((ours / "config.json").read_text())["torch_dtype"] == "bfloat16"
