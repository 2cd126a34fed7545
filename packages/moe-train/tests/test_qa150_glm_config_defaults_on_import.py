"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

A hand-written GLM-4-MoE config.json may leave out norm_topk_prob and n_shared_experts; transformers then uses
Glm4MoeConfig's defaults (True, 1), and the import must too. save_pretrained writes both keys, so the tests never
read the defaults: importing with norm_topk_prob defaulting to False, or n_shared_experts to 0, passed them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers")

from test_qa94 import MOE, assert_imports_exactly, edit_config, save_random  # noqa: E402


@pytest.mark.parametrize("key", ["norm_topk_prob", "n_shared_experts"])
def test_a_glm4_moe_config_without_the_key_imports_as_transformers_reads_it(tmp_path, key):
    folder = save_random(tmp_path, "glm4_moe", **dict(MOE, n_routed_experts=4, first_k_dense_replace=1,
                                                       norm_topk_prob=True, n_shared_experts=1))
    edit_config(folder, **{key: None})  # transformers falls back on Glm4MoeConfig's default
    assert_imports_exactly(folder)
