"""QA 151: checks a mutation audit of moe-ckpt (review helper 165) found no moe-ckpt test making. Each test here fails
on the mutant named in its docstring or comment and passes on the code:
- HF export: experts' gate and up swapped (C22); GLM's fp32 selection bias rounded to the export dtype, or counted
  at 2 bytes in total_size (C26, C28); a model of exactly max_shard_bytes split in two (C25); a tokenizer id equal
  to vocab_size accepted (C27); GLM's first_k_dense_replace one short (C30); a tied export dropping a different
  lm_head (C37);
- HF import: gate/up joined in the wrong order (C23); Qwen2-MoE's ungated shared expert at twice its weight (C24);
  decoder_sparse_step's dense layers off by one (C29); a weight_map naming a shard that lacks the tensor (C36);
- saves: the shard file, metadata.json or index.json not fsynced before the commit (C16, C17); the tmp folder not
  fsynced before its rename (C19); the shard header not padded to 8 bytes (C18);
- loads: an index naming one rank twice (C08); a shard file that grew, with verify=False (C11).
moe-train's transformers tests catch some of the HF mapping mutants through logits; these catch them in moe-ckpt alone,
as a user of the package gets it.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path

import moe_ckpt.save
import pytest
import torch
from ckpt_cases import HF_MODEL as MODEL
from ckpt_cases import HF_ROUTER as ROUTER
from moe_ckpt import Box, ShardSpec, load_checkpoint, save_checkpoint, step_dir
from moe_ckpt.errors import ChecksumMismatchError, CorruptMetadataError
from moe_ckpt.hf import export_hf_folder, from_hf_config, open_hf_folder, to_hf_config
from moe_ckpt.hf.layout import build_plan
from safetensors import safe_open

GLM = dict(qk_norm=True, router={**ROUTER, "gating": "sigmoid", "expert_bias": True})


def model(**kw) -> dict:
    return copy.deepcopy({**MODEL, **kw})


def source(m: dict, model_type: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {e.ours: 0.1 * torch.randn(e.our_shape, generator=g) for e in build_plan(m, model_type) if e.ours}


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


# ---- HF export --------------------------------------------------------------------------------------------------

def test_expert_gate_and_up_land_in_gate_proj_and_up_proj(tmp_path):
    """w_gate_up [E, d, 2h] is (gate | up) along its last dim: gate_proj = w[j, :, :h].T, up_proj = w[j, :, h:].T."""
    m = model()
    sd = source(m, "qwen3_moe")
    export_hf_folder(m, sd, tmp_path / "hf", dtype="fp32")
    got = read_folder(tmp_path / "hf")
    w, h = sd["blocks.1.mlp.experts.w_gate_up"], m["expert_hidden"]
    for j in range(m["num_experts"]):
        assert torch.equal(got[f"model.layers.1.mlp.experts.{j}.gate_proj.weight"], w[j, :, :h].t())
        assert torch.equal(got[f"model.layers.1.mlp.experts.{j}.up_proj.weight"], w[j, :, h:].t())
        assert torch.equal(got[f"model.layers.1.mlp.experts.{j}.down_proj.weight"],
                           sd["blocks.1.mlp.experts.w_down"][j].t())


def test_glm_selection_bias_stays_fp32_in_a_bf16_export_and_total_size_counts_it_at_4_bytes(tmp_path):
    """e_score_correction_bias is kept fp32 (transformers keeps it fp32; bf16 would round the learned bias) and the
    index's total_size is the bytes the shards hold."""
    m = model(**GLM)
    sd = source(m, "glm4_moe")
    summary = export_hf_folder(m, sd, tmp_path / "hf", dtype="bf16", max_shard_bytes=20_000)
    got = read_folder(tmp_path / "hf")
    bias = got["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, sd["blocks.0.mlp.router.expert_bias"])
    held = sum(t.numel() * t.element_size() for t in got.values())
    assert summary.shards > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == held == summary.total_bytes


def test_a_max_shard_bytes_equal_to_the_whole_model_writes_one_file(tmp_path):
    """max_shard_bytes is the most a shard holds: a model of exactly that many bytes fits in one file."""
    m = model()
    sd = source(m, "qwen3_moe")
    total = export_hf_folder(m, sd, tmp_path / "probe", dtype="fp32").total_bytes
    summary = export_hf_folder(m, sd, tmp_path / "hf", dtype="fp32", max_shard_bytes=total)
    assert summary.shards == 1
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_tokenizer_id_equal_to_vocab_size_is_refused(tmp_path):
    """Ids run 0..vocab_size-1: an id == vocab_size has no embedding row."""
    from moe_ckpt.hf import HFConversionError

    m = model()
    tok = tmp_path / "tokenizer.json"
    vocab = {f"t{i}": i for i in range(m["vocab_size"] + 1)}  # ids 0..64 for a 64-row embedding
    tok.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
                               "added_tokens": []}))
    with pytest.raises(HFConversionError, match=r"token ids up to 64, but model.vocab_size=64"):
        export_hf_folder(m, source(m, "qwen3_moe"), tmp_path / "hf", tokenizer_json=tok)


def test_glm_first_k_dense_replace_is_the_number_of_leading_dense_layers():
    m = model(**GLM, num_layers=4, dense_layers=[0, 1])
    assert to_hf_config(m, "glm4_moe", "bf16")["first_k_dense_replace"] == 2


# ---- save: durability -----------------------------------------------------------------------------------------

def _fsynced_paths(monkeypatch) -> list[str]:
    """Every path os.fsync is called on (read from /proc/self/fd), in order."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        try:
            seen.append(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
        except OSError:
            seen.append("?")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_a_save_fsyncs_the_shard_file_metadata_and_index_before_committing(tmp_path, monkeypatch):
    """Each file a save writes is fsynced: after a power loss a committed checkpoint could otherwise
    hold a shard file of zeros (or a short index.json) whose checksum then fails every resume."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    seen = _fsynced_paths(monkeypatch)
    path = step_dir(tmp_path, 1)
    save_checkpoint(path, [ShardSpec("w", (4, 2), torch.randn(4, 2))], {"step": 1})
    names = [Path(p).name for p in seen]
    assert any(n.startswith("shard-00000-of-00001.safetensors") for n in names), names
    assert any(n.startswith(".metadata.json.tmp") for n in names), names
    assert any(n.startswith(".index.json.tmp") for n in names), names


def test_the_tmp_folder_is_fsynced_after_its_last_entry_and_before_the_rename(tmp_path, monkeypatch):
    """fsync_dir(tmp) makes index.json's rename into the tmp folder (and the manifests' removal) durable before the
    folder is renamed into place; without it a crash can leave a committed name without index.json."""
    events: list[str] = []
    real_fsync_dir, real_rename = moe_ckpt.save.fsync_dir, os.rename
    monkeypatch.setattr(moe_ckpt.save, "fsync_dir", lambda p: (events.append(f"fsync_dir {Path(p).name}"),
                                                               real_fsync_dir(p))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(f"rename {Path(a).name}"), real_rename(a, b))[1])
    path = step_dir(tmp_path, 1)
    save_checkpoint(path, [ShardSpec("w", (3,), torch.randn(3))])
    tmp_name = path.name + ".tmp"
    rename_at = events.index(f"rename {tmp_name}")
    assert f"fsync_dir {tmp_name}" in events[:rename_at], events




# ---- index / load: damaged checkpoints --------------------------------------------------------------------------


def two_rank_save(path: Path, w: torch.Tensor) -> Path:
    """w split in dim 0 over 2 simulated ranks (threads)."""
    bar = threading.Barrier(2, timeout=60)
    errors = []

    def rank(r: int) -> None:
        try:
            rows = w.shape[0] // 2
            save_checkpoint(path, [ShardSpec("w", tuple(w.shape), w[r * rows:(r + 1) * rows],
                                             Box.dim0(tuple(w.shape), r * rows, rows))], {"step": 1}, r, 2, bar.wait)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return path


def edit_index(ck: Path, fn) -> None:
    idx = json.loads((ck / "index.json").read_text())
    fn(idx)
    (ck / "index.json").write_text(json.dumps(idx))




def test_an_index_whose_files_name_one_rank_twice_is_refused(tmp_path):
    ck = two_rank_save(tmp_path / "ck", torch.arange(8.0).reshape(4, 2))
    edit_index(ck, lambda idx: [rec.update(rank=0) for rec in idx["files"].values()])
    with pytest.raises(CorruptMetadataError, match=r"shard files of ranks \[0, 0\], expected one per rank"):
        load_checkpoint(ck)


def test_a_shard_file_grown_since_the_save_is_refused_even_without_verify(tmp_path):
    """File sizes are always checked (verify=False skips only the checksum pass)."""
    ck = save_checkpoint(tmp_path / "ck", [ShardSpec("w", (3,), torch.randn(3))])
    with open(ck / "shard-00000-of-00001.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(ChecksumMismatchError, match=r"index.json says \d+: truncated or corrupt"):
        load_checkpoint(ck, verify=False)




def test_the_shard_file_header_is_padded_to_a_multiple_of_8_bytes(tmp_path):
    """The data section then starts 8-byte aligned, as safetensors' own writer leaves it (aligned memory-mapped
    tensors for any dtype)."""
    for n in range(1, 9):  # header lengths of every residue
        ck = save_checkpoint(tmp_path / f"ck{n}", [ShardSpec("w" * n, (n,), torch.randn(n))])
        raw = (ck / "shard-00000-of-00001.safetensors").read_bytes()
        assert int.from_bytes(raw[:8], "little") % 8 == 0




# ---- HF import ----------------------------------------------------------------------------------------------------

def test_qwen2_moe_export_then_import_gives_back_every_tensor(tmp_path):
    """Qwen2-MoE with an ungated shared expert: its down_proj is written doubled and halved again on import; expert
    gate/up split and re-joined in order."""
    m = model(qk_norm=False, shared_expert_hidden=16)
    sd = source(m, "qwen2_moe")
    export_hf_folder(m, sd, tmp_path / "hf", dtype="fp32")
    back = open_hf_folder(tmp_path / "hf").state_dict()
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert torch.equal(back[name], t), name


def test_decoder_sparse_step_makes_the_layers_off_the_step_dense():
    """transformers: layer i is sparse when (i + 1) % decoder_sparse_step == 0."""
    c = to_hf_config(model(num_layers=4), "qwen3_moe", "fp32")
    c["decoder_sparse_step"] = 2
    m, _ = from_hf_config(c)
    assert m["dense_layers"] == [0, 2]




def test_an_hf_index_mapping_a_tensor_to_a_shard_that_lacks_it_is_refused_at_open(tmp_path):
    from moe_ckpt.hf import HFConversionError

    m = model()
    export_hf_folder(m, source(m, "qwen3_moe"), tmp_path / "hf", dtype="fp32", max_shard_bytes=20_000)
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFConversionError, match=rf"maps tensor {name} to {files[1]}, which does not hold it"):
        open_hf_folder(tmp_path / "hf")


def test_a_tied_export_whose_source_head_differs_from_the_embedding_is_refused(tmp_path):
    """tie_embeddings=True writes embed.weight for both: a different lm_head.weight would be dropped silently."""
    from moe_ckpt.hf import HFConversionError

    m = model(tie_embeddings=True)
    sd = source(m, "qwen3_moe")
    sd["lm_head.weight"] = sd["embed.weight"] + 1
    with pytest.raises(HFConversionError, match=r"lm_head\.weight differs from its embed\.weight"):
        export_hf_folder(m, sd, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
