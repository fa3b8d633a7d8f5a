"""The dense training forward (model/dense_forward.py) on the Transformer's own
modules against HF transformers, on every feature the loader covers (GQA,
rope scaling, biases, q/k/v bias, sliding windows), and that it trains."""
import pytest
import torch

from agentkv.model.dense_forward import dense_hidden, dense_logits, trainable_parameters
from agentkv.model.loader import hf_tensors, load_model
from tests.hf_models import HF_MODELS, make_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_hf_model(request.param, path), path


def test_dense_forward_matches_hf_on_a_padded_batch(pair):
    hf, path = pair
    model = load_model(path)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 320, (3, 60), generator=g)
    lengths = [60, 41, 7]  # right padding must not reach the earlier tokens
    with torch.no_grad():
        ours = dense_logits(model, dense_hidden(model, ids))
        for row, n in enumerate(lengths):
            ref = hf(ids[row : row + 1, :n]).logits[0]
            torch.testing.assert_close(ours[row, :n], ref, atol=ATOL, rtol=0)


def test_dense_forward_trains_every_parameter_and_exports_what_it_trained(pair):
    _, path = pair
    model = load_model(path)
    params = trainable_parameters(model)
    assert ("lm_head" in params) == (not model.cfg.tie_word_embeddings)
    ids = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(5))
    logits = dense_logits(model, dense_hidden(model, ids[:, :-1]))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    for name, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt = torch.optim.SGD(params.values(), lr=1.0)
    opt.step()
    # The HF view of the trained weights carries the update (the embedding of a tied model included).
    tensors = hf_tensors(model)
    embed = model.embed.detach()
    assert torch.equal(tensors["model.embed_tokens.weight"], embed)
    assert torch.equal(tensors["model.layers.0.self_attn.o_proj.weight"], model.blocks[0].attn.o_weight.detach().t())
