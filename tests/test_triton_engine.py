"""The whole engine on its Triton path (the interpreter on a CPU) against its
torch path: same tokens from the same weights."""
import pytest
import torch

from agentkv import Engine
from agentkv.experiments.common import random_model

pytestmark = pytest.mark.slow


@pytest.fixture
def model(device):
    return random_model("tiny", torch.float32, seed=5, device=device)


def run(model, monkeypatch, kernels: str) -> tuple[list[int], torch.Tensor]:
    monkeypatch.setenv("AGENTKV_KERNELS", kernels)
    engine = Engine(model, None, page_size=16, num_pages=8)
    with engine.session() as s:
        logits = [s.append(list(range(3, 24)), all_logits=True)]  # crosses a page
        logits.append(s.append([7, 100, 3], all_logits=True))
        out = s.generate(max_tokens=8, ignore_eos=True, speculative=False)
        logits.append(s.append([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], all_logits=True))  # mid-page start
        out += s.generate(max_tokens=8, ignore_eos=True, speculative=True)
    return out, torch.cat(logits)


def test_triton_path_matches_torch_path(model, monkeypatch):
    ref_tokens, ref_logits = run(model, monkeypatch, "torch")
    tokens, logits = run(model, monkeypatch, "triton")
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
