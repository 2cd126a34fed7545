"""tools/profile_train_step.py runs the trainer's step path and reports where the time goes (CPU here)."""

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "profile_train_step.py"


def test_profiles_a_tiny_step_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("profile_train_step", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "p.json"
    report = tool.main(["--preset", "tiny", "--steps", "1", "--warmup", "1", "--top", "8", "--out", str(out),
                        "--train.device=cpu", "--model.num_layers=2", "--train.micro_batch_size=2",
                        "--train.activation_checkpointing=mlp"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["gpu_busy_ms"] is None and report["step_wall_ms_profiled"] > 0
    ops = {o["op"] for o in report["top_ops"]}
    assert len(report["top_ops"]) == 8 and any(op.startswith("aten::") for op in ops)
    assert "by operator (self CPU time)" in capsys.readouterr().out
    assert tool.family("_grouped_wgrad_kernel") == "triton" and tool.family("nvjet_sm90_tst_256x128") == "gemm"
