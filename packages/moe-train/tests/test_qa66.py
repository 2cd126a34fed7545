"""QA 66: today's features on inputs their tests did not use. train.init_from given as `~/...` (the shell leaves it
as typed, as it does train.run_dir, which is expanded); train.init_from given a Hugging Face folder, whose refusal
said nothing of import-hf; a model section given as a dict, which validate_model (MoELayer / Attention / Transformer
built alone) met with an AttributeError instead of naming the field."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import init_from_worker as w  # noqa: E402

from moe_ckpt.hf import export_hf_folder  # noqa: E402
from moe_precision import PrecisionRecipe  # noqa: E402
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, validate, validate_model  # noqa: E402
from moe_train.model import Transformer  # noqa: E402
from moe_train.model.moe import MoELayer  # noqa: E402
from moe_train.model.router import Router  # noqa: E402
from moe_train.config_io import build_config  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402


def test_init_from_under_the_home_folder_is_expanded_as_run_dir_is(tmp_path, monkeypatch):
    """The shell leaves `--train.init_from=~/src` as typed; build_config expands it as it does train.run_dir."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = build_config("tiny", overrides={"train.init_from": "~/src", "train.run_dir": "~/run"})
    assert (cfg.train.init_from, cfg.train.run_dir) == (str(tmp_path / "src"), str(tmp_path / "run"))


@pytest.mark.parametrize("shard_bytes", [2**30, 20_000])  # one model.safetensors, or shards and an index
def test_init_from_a_hugging_face_folder_says_to_import_it_first(shard_bytes, tmp_path, data_dir):
    cfg = w.config(tmp_path / "b", str(data_dir), str(tmp_path / "hf"))
    export_hf_folder(dataclasses.asdict(cfg.model), Transformer(cfg.model).state_dict(), tmp_path / "hf",
                     max_shard_bytes=shard_bytes)  # what a download of this very model holds
    with pytest.raises(ConfigError, match=r"train.init_from='.*hf' is a Hugging Face model folder \(config.json "
                                          r"model_type='glm4_moe'\), not ours: convert it first with `moe-train "
                                          r"import-hf .*hf OUT`, then train.init_from=OUT"):
        Trainer(cfg).train()


@pytest.mark.parametrize("build,message", [
    (lambda: validate_model(ModelConfig(router={"top_k": 1})), r"model.router=\{'top_k': 1\}: expected a RouterConfig"),
    (lambda: MoELayer(ModelConfig(router=None), PrecisionRecipe()), r"model.router=None: expected a RouterConfig"),
    (lambda: validate(Config(model={"num_layers": 2})), r"model=\{'num_layers': 2\}: expected a ModelConfig"),
    (lambda: validate(Config(model=RouterConfig())), r"model=RouterConfig\(.*\): expected a ModelConfig"),
])
def test_a_config_section_that_is_not_its_dataclass_is_refused_by_name(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize("build,message", [
    (lambda: Router(16, 4, RouterConfig(gating="relu")), r"model.router.gating='relu': expected one of softmax, sigmoid"),
    (lambda: Router(16, 4, RouterConfig(routing="bogus")), r"model.router.routing='bogus': expected one of"),
    (lambda: Router(16, 4, RouterConfig(top_k=2.0)), r"model.router.top_k=2.0: expected an integer"),
    (lambda: Router(16, 4, RouterConfig(routed_scaling_factor=-1.0)), r"model.router.routed_scaling_factor=-1.0"),
    (lambda: Router(16, 0, RouterConfig()), r"Router: num_experts=0: expected an integer >= 1"),
    (lambda: MoELayer(ModelConfig(num_experts=0), PrecisionRecipe()), r"MoELayer: model.num_experts=0: expected >= 1"),
])
def test_a_router_built_alone_checks_every_router_field(build, message):
    """Before: only top_k was checked; gating='relu' computed sigmoid and routing='bogus' routed uniformly."""
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_dense_model_starts_from_the_import_of_its_own_export(tmp_path, data_dir):
    """An HF round trip resets the fields only MoE layers read (dense_layers, expert_hidden, router.*) to their
    defaults; for a dense model they change nothing, and init_from refused the import as another model."""
    from moe_train.hf_bridge import export_hf, import_hf

    def dense(run: Path, init_from: str | None) -> Config:
        cfg = w.config(run, str(data_dir), init_from, steps=1)
        cfg.model.num_experts, cfg.model.shared_expert_hidden = 0, 0
        return cfg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warmup_steps > steps
        trainer = Trainer(dense(tmp_path / "src", None))
        trainer.train()
        export_hf(tmp_path / "src", tmp_path / "hf", dtype="fp32")
        import_hf(tmp_path / "hf", tmp_path / "imported")
        again = Trainer(dense(tmp_path / "b", str(tmp_path / "imported")))
        seen = w.before_first_step(again)
        again.train()
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(seen["shards"][name][2], t), name


@pytest.mark.parametrize("steps", [[3, 3], [3, 5]])
def test_ranks_that_resolved_different_checkpoints_of_the_source_refuse_together(steps, tmp_path):
    """Each rank looks up a run folder's latest checkpoint on its own; a run still saving can move it between the
    lookups, and replicas would start from different weights without a word."""
    
    import test_parallel_harness as h

    h.start_ranks(h.run_guarded, args=(w.resolve_steps, str(tmp_path), h.free_port(), steps), nprocs=2)
    refused = [r["refused"] for r in h.load_results(tmp_path, 2)]
    if steps[0] == steps[1]:
        assert refused == [None, None]
    else:
        for rank, text in enumerate(refused):
            assert text is not None and f"this rank: step-{steps[rank]:08d}" in text, (rank, text)
            assert "the ranks resolved different checkpoints of /nowhere/checkpoints" in text
