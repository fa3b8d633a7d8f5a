"""The hand-written model against HF transformers on the same weights (fp32)."""
import pytest
import torch

from agentkv import Engine
from tests.hf_models import HF_MODELS, make_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path)
    return hf, path


@pytest.fixture
def engine(pair):
    return Engine.from_pretrained(pair[1], page_size=8, num_pages=64)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_full_prefill_matches_hf(pair, engine):
    hf, _ = pair
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with engine.session() as s:
        ours = s.append(ids, all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_uneven_appends_across_pages_match_hf(pair, engine):
    hf, _ = pair
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    chunks = [1, 7, 8, 3, 17, 1, 24, 9]  # page size 8: starts mid-page, crosses pages
    assert sum(chunks) == len(ids)
    with engine.session() as s:
        outs, start = [], 0
        for n in chunks:
            outs.append(s.append(ids[start : start + n], all_logits=True))
            start += n
        assert len(s) == len(ids)
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_greedy_32_tokens_match_hf_generate(pair, engine):
    hf, _ = pair
    prompt = torch.randint(0, 320, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 13:].tolist()
    with engine.session() as s:
        s.append(prompt)
        ours = s.generate(max_tokens=32, temperature=0.0, ignore_eos=True)
        assert s.tokens == prompt + ours
    assert ours == ref
