"""`prepare-data --eval-fraction P` holds out P of the tokens for eval (it was fixed at 0.02 on the command line), and
a share prepare-data cannot hold out is refused naming the flag, before any output is written."""

from __future__ import annotations

import json

import pytest

from moe_train.cli import main

DOCS = ["".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(40)) for i in range(30)]


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i}.py").write_text(doc)
    return folder


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_eval_fraction_holds_out_that_share_of_the_tokens(tmp_path, corpus, fraction):
    out = tmp_path / "data"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--vocab-size", "300",
                 "--eval-fraction", str(fraction)]) == 0
    splits = json.loads((out / "meta.json").read_text())["splits"]
    held_out = splits["eval"]["num_tokens"] / (splits["eval"]["num_tokens"] + splits["train"]["num_tokens"])
    assert abs(held_out - fraction) < 0.03, held_out


@pytest.mark.parametrize("given, expected", [("1e-7", "--eval-fraction=1e-07: expected between 1e-06 and 1 - 1e-06"),
                                             ("1.5", "--eval-fraction=1.5: expected in (0, 1)"),
                                             ("nan", "--eval-fraction=nan: expected in (0, 1)")])
def test_an_eval_fraction_it_cannot_hold_out_is_refused_naming_the_flag(tmp_path, corpus, capsys, given, expected):
    out = tmp_path / "data"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--eval-fraction", given]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()
