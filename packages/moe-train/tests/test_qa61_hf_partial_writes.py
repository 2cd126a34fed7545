"""QA 61: an import-hf / export-hf that fails part-way leaves its output folder exactly as it was.

A failure is injected at every file-system write the command makes in turn (the k-th rename, copy, text write
or safetensors save raises), over an earlier output of another model: each time, the folder must hold that
earlier output byte for byte (never a new config.json beside the old weights), and nothing may be left beside it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import socket
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import safetensors.torch
import torch

import moe_ckpt.hf.export
import moe_train.hf_bridge
from moe_ckpt.hf import FolderWriteError, export_hf_folder
from moe_train.cli import main
from moe_train.config import Config, ModelConfig, validate
from moe_train.data import train_bpe
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer


def _model(seed: int, **kw) -> Transformer:
    fields = dict(vocab_size=300, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, dense_hidden=16,
                  num_experts=2, expert_hidden=8, router={"top_k": 1, "normalize_top_k": False})
    fields.update(kw)
    router = fields.pop("router")
    cfg = validate(Config(model=ModelConfig(**fields))).model
    cfg.router.top_k, cfg.router.normalize_top_k = router["top_k"], router["normalize_top_k"]
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def _hf_folder(path: pathlib.Path, seed: int, with_tokenizer: bool, **kw) -> pathlib.Path:
    model = _model(seed, **kw)
    kwargs = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tok = path.parent / f"tok{seed}.json"
        train_bpe(["hello world, mixture of experts"] * 20, 280).save(str(tok))
        kwargs["tokenizer_json"] = tok
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), path, dtype="fp32",
                     extra_config={"eos_token_id": seed}, **kwargs)
    return path


def _snapshot(folder: pathlib.Path) -> dict[str, bytes] | None:
    """Every file's bytes by name; None when the folder is gone."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else None


class _Injected(OSError):
    pass


def _fail_at(monkeypatch, k: int) -> list[int]:
    """Make the k-th file-system write (os.replace / os.rename / shutil.copyfile / Path.write_text / a safetensors
    save, wherever it is called from) raise; returns the running count."""
    count = [0]

    def wrap(fn):
        def wrapped(*args, **kwargs):
            count[0] += 1
            if count[0] == k:
                raise _Injected(f"injected failure at write {k}")
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(os, "replace", wrap(os.replace))
    monkeypatch.setattr(os, "rename", wrap(os.rename))
    monkeypatch.setattr(shutil, "copyfile", wrap(shutil.copyfile))
    monkeypatch.setattr(pathlib.Path, "write_text", wrap(pathlib.Path.write_text))
    saver = wrap(safetensors.torch.save_file)
    for module in (safetensors.torch, moe_train.hf_bridge, moe_ckpt.hf.export):
        if hasattr(module, "save_file"):
            monkeypatch.setattr(module, "save_file", saver)
    return count


def _every_failure_point_keeps_the_earlier_output(run, out: pathlib.Path, monkeypatch) -> None:
    before = _snapshot(out)
    beside = sorted(p.name for p in out.parent.iterdir())
    for k in range(1, 100):
        with monkeypatch.context() as m:
            count = _fail_at(m, k)
            try:
                run()
            except OSError as e:  # inside the new folder's writing it comes wrapped (FolderWriteError, moe-ckpt 0.21.8)
                if not isinstance(e, _Injected) and not isinstance(e.__cause__, _Injected):
                    raise
                failed = True
            else:
                failed = False
        if not failed:  # k is past the last write: the run completed
            assert count[0] < k and _snapshot(out) != before
            return
        assert _snapshot(out) == before, f"a failure at write {k} of the run left {out} half-replaced"
        assert sorted(p.name for p in out.parent.iterdir()) == beside, f"a failure at write {k} left files beside"
    raise AssertionError("the run never completed")


@pytest.mark.parametrize("tokenizers", [(True, True), (False, True), (True, False)], ids=["both", "new", "old"])
def test_an_import_that_fails_at_any_write_leaves_the_earlier_import_whole(tokenizers, tmp_path, monkeypatch):
    """Before, import_hf renamed tokenizer.json, hf_extra.json, config.json and model.safetensors into place one at
    a time (and deleted an earlier tokenizer first): a failure between two renames left the new model's config.json
    (a 2-layer model) beside the earlier import's weights (a 1-layer one), or the earlier model without its
    tokenizer."""
    old_tok, new_tok = tokenizers
    old = _hf_folder(tmp_path / "a" / "hf", seed=1, with_tokenizer=old_tok)
    new = _hf_folder(tmp_path / "b" / "hf", seed=2, with_tokenizer=new_tok, num_layers=2)
    out = tmp_path / "runs" / "imported"
    import_hf(old, out)
    _every_failure_point_keeps_the_earlier_output(lambda: import_hf(new, out), out, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(out, tmp_path / "again", dtype="fp32")  # the completed import is a whole checkpoint
    assert (out / "tokenizer.json").is_file() == new_tok


def test_an_export_that_fails_at_any_write_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
    """Before, a failure of the rename that moved the new folder in (after the previous export was moved aside)
    left out_dir missing, the previous export in a hidden `.NAME.old-*` folder until the next export to it."""
    out = tmp_path / "exports" / "hf"
    _hf_folder(out, seed=1, with_tokenizer=True)
    model = _model(2, num_layers=2)
    _every_failure_point_keeps_the_earlier_output(
        lambda: export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), out, dtype="fp32"), out,
        monkeypatch)


def test_import_hf_cli_replaces_an_earlier_import_whole(tmp_path, capsys):
    old = _hf_folder(tmp_path / "a" / "hf", seed=1, with_tokenizer=True)
    new = _hf_folder(tmp_path / "b" / "hf", seed=2, with_tokenizer=False, num_layers=2)
    out = tmp_path / "imported"
    assert main(["import-hf", str(old), str(out)]) == 0
    assert main(["import-hf", str(new), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hf_extra.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "imported"]
    assert "2 layers" in capsys.readouterr().out


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_an_import_killed_between_its_renames_is_restored_by_the_next_import(tmp_path, monkeypatch):
    """Killed after moving the earlier import aside and before moving the new one in, an import leaves no out_dir
    and the earlier import in `.NAME.old-HOST-PID-X` (and its partial folder in `.NAME.tmp-...`). The next import to
    the same out_dir puts the earlier import back (warning that it did) before it writes: if it fails too, the
    earlier import is in place; the leftovers are gone either way."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]  # as the temporary folders' names spell it
    old = _hf_folder(tmp_path / "a" / "hf", seed=1, with_tokenizer=True)
    new = _hf_folder(tmp_path / "b" / "hf", seed=2, with_tokenizer=False, num_layers=2)
    runs = tmp_path / "runs"
    out = runs / "imported"
    import_hf(old, out)
    before = _snapshot(out)
    dead = _dead_pid()
    os.rename(out, runs / f".imported.old-{host}-{dead}-0123abcd")
    (runs / f".imported.tmp-{host}-{dead}-89abcdef").mkdir()
    with monkeypatch.context() as m:
        m.setattr(moe_train.hf_bridge, "save_file", lambda *a, **k: (_ for _ in ()).throw(_Injected("disk full")))
        with pytest.warns(UserWarning, match=r"import to .*out_dir was missing and \.imported\.old-.* held the "
                                             r"previous import, .* restored it to imported"):
            with pytest.raises(FolderWriteError, match="disk full") as info:
                import_hf(new, out)
    assert isinstance(info.value.__cause__, _Injected)
    assert _snapshot(out) == before and sorted(p.name for p in runs.iterdir()) == ["imported"]
    import_hf(new, out)
    assert _snapshot(out) != before and sorted(p.name for p in runs.iterdir()) == ["imported"]
