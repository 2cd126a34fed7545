"""HF export leftovers on a shared file system: a pid names a process only on the host that wrote it, so an
export's folders carry its host, and the next export removes only this host's leftovers of exited processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_ckpt.hf.layout import build_plan

HOST = "node-12"  # a name ending in -digits, like a pid: the parse must take the pid from the end
OTHER = "node-1"

# A one-layer dense model (LlamaForCausalLM): the export takes milliseconds.
MODEL = dict(vocab_size=16, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=None, dense_hidden=16,
             num_experts=0, qk_norm=False, tie_embeddings=True, rope_theta=10_000.0, norm_eps=1e-5, init_std=0.02,
             dense_layers=[])


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: HOST)


def _source(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {e.ours: torch.full(e.our_shape, value) for e in build_plan(MODEL, "llama") if e.ours is not None}


def _export(out, value: float = 1.0, source=None) -> None:
    export_hf_folder(MODEL, source or _source(value), out, dtype="fp32")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped) on this host."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _folder(path, content: str = "x"):
    path.mkdir()
    (path / "model.safetensors").write_text(content)
    return path


def test_an_export_names_its_temporary_folder_with_its_host_and_pid(tmp_path):
    seen = []

    def source(name: str) -> torch.Tensor:  # called while the temporary folder is being written
        seen.extend(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf."))
        return _source()[name]

    _export(tmp_path / "hf", source=source)
    assert seen and re.fullmatch(rf"\.hf\.tmp-{HOST}-{os.getpid()}-[0-9a-f]{{8}}", seen[0]), seen
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_only_this_hosts_leftovers_of_exited_exports_are_removed_and_another_hosts_are_named_in_a_warning(tmp_path):
    """The same dead pid on another host says nothing about that host's process: its folders stay, and the
    warning names them. Names without a host (moe-ckpt 0.5.0) or without a pid (<= 0.4.1) are read as before."""
    out, dead, alive = tmp_path / "hf", _dead_pid(), os.getppid()
    _export(out)
    removed = [_folder(tmp_path / n) for n in (f".hf.tmp-{HOST}-{dead}-0123abcd", f".hf.old-{HOST}-{dead}-89abcdef",
                                                f".hf.tmp-{dead}-0123abcd", ".hf.old-00c0ffee")]
    kept = [_folder(tmp_path / n) for n in (f".hf.tmp-{HOST}-{alive}-0123abcd", f".hf.tmp-{alive}-89abcdef")]
    foreign = [_folder(tmp_path / n) for n in (f".hf.tmp-{OTHER}-{dead}-0123abcd", f".hf.old-{OTHER}-{alive}-0123abcd",
                                                f".hf.tmp-gpu7.cluster.example-{dead}-0123abcd")]
    with pytest.warns(UserWarning) as got:
        _export(out, 2.0)
    assert not any(p.exists() for p in removed)
    assert all((p / "model.safetensors").read_text() == "x" for p in [*kept, *foreign])
    [warning] = [str(w.message) for w in got]
    assert f"left {', '.join(sorted(p.name for p in foreign))} beside it alone: made by an export on another " \
           f"host (this is {HOST}), which may still be running" in warning
    assert sorted(p.name for p in out.iterdir()) == [".moe_ckpt_export", "config.json", "generation_config.json",
                                                      "model.safetensors"]


def test_a_moved_aside_export_is_restored_only_when_this_host_left_it(tmp_path):
    """Killed between its two renames, an export leaves no `hf` and the previous export moved aside. One that
    another host moved aside may belong to an export running there right now: it is not taken over."""
    out, dead = tmp_path / "hf", _dead_pid()
    _export(out)
    before = (out / "model.safetensors").read_bytes()
    foreign = tmp_path / f".hf.old-{OTHER}-{dead}-0123abcd"
    os.rename(out, foreign)
    with pytest.warns(UserWarning, match=rf"left {foreign.name} beside it alone: made by an export on another host"):
        _export(out, 2.0)
    assert (foreign / "model.safetensors").read_bytes() == before
    assert (out / "model.safetensors").read_bytes() != before

    second = (out / "model.safetensors").read_bytes()
    ours = tmp_path / f".hf.old-{HOST}-{dead}-89abcdef"
    os.rename(out, ours)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with pytest.raises(HFConversionError):  # this export fails: the restored previous export stays in place
            _export(out, source=lambda name: {}[name])
    assert any(f"out_dir was missing and {ours.name} beside it held the previous export" in str(w.message)
               for w in got)
    assert not ours.exists() and (out / "model.safetensors").read_bytes() == second
