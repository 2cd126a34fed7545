"""QA 132: load's request check (0.20.2) read a bare name passed as requests letter by letter, and its message
told the user to wrap the first letter: LoadRequest('w')."""

import pytest
import torch

from moe_ckpt import LoadRequest, ShardSpec, load_checkpoint, open_checkpoint, save_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tmp_path / "step-1", [ShardSpec("w.weight", (4,), torch.arange(4.0))])


@pytest.mark.parametrize("requests", ["w.weight", LoadRequest("w.weight")])
def test_a_bare_name_or_request_as_requests_names_the_whole_name(ckpt, requests):
    with pytest.raises(TypeError, match=r"requests is a \w+ .*expected a list of LoadRequests \(e\.g\. "
                                        r"\[LoadRequest\('w\.weight'\)\]\)"):
        load_checkpoint(ckpt, requests)
    with open_checkpoint(ckpt) as c, pytest.raises(TypeError, match=r"\[LoadRequest\('w\.weight'\)\]"):
        c.read(requests)


def test_a_tuple_or_generator_of_requests_still_loads(ckpt):
    assert list(load_checkpoint(ckpt, (LoadRequest("w.weight"),))) == ["w.weight"]
    assert list(load_checkpoint(ckpt, (LoadRequest(n) for n in ["w.weight"]))) == ["w.weight"]
