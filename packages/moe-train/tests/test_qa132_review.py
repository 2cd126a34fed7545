"""QA 132: Transformer.forward's token check (0.21.33) reads the ids' values; under torch.func.vmap and under a
FakeTensorMode there are none to read, and the forward that ran before the check raised."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_train.config import ModelConfig
from moe_train.model.transformer import Transformer

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, dense_hidden=64, num_experts=0)


def test_transformer_runs_under_vmap_as_it_did_before_the_token_check():
    torch.manual_seed(0)
    model = Transformer(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (3, 2, 5))  # three [2, 5] batches
    with torch.no_grad():
        batched, _ = torch.func.vmap(model)(tokens)
        one_by_one = torch.stack([model(t)[0] for t in tokens])
    torch.testing.assert_close(batched, one_by_one)


def test_transformer_runs_under_fake_tensor_mode():
    with FakeTensorMode():
        model = Transformer(CFG)
        logits, _ = model(torch.randint(0, CFG.vocab_size, (2, 5)))
    assert logits.shape == (2, 5, CFG.vocab_size)


def test_out_of_vocab_ids_are_still_refused_on_a_plain_cpu_tensor():
    model = Transformer(CFG)
    try:
        model(torch.tensor([[1, CFG.vocab_size]]))
    except IndexError as e:
        assert "tokens[0, 1]=64" in str(e)
    else:
        raise AssertionError("an id outside the vocabulary was accepted")


def test_a_numpy_float64_eval_fraction_names_the_folder_a_float_does():
    """0.21.30 named the embedded corpus's folder by eval_fraction's repr: numpy 2's is "np.float64(0.03)", a second
    folder (with parentheses in its name) for the same data; validate takes numpy's float64, a float subclass."""
    import numpy as np

    from moe_train.config import DataConfig
    from moe_train.trainer.data_setup import default_data_dir

    assert default_data_dir(DataConfig(eval_fraction=np.float64(0.03))) == default_data_dir(DataConfig(eval_fraction=0.03))
    assert default_data_dir(DataConfig(eval_fraction=0.03)).name.endswith("-e0.03")
