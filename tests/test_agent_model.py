"""The agent model's training script end to end (a few seconds of CPU): its
checkpoint loads in our engine and in transformers with matching logits, and
its data never shows a held-out tool or argument name to training."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import Engine
from experiments import agent_data as D
from experiments.train_agent_model import TrainLlama, load_hf_weights
from model.default_tokenizer import build_default_tokenizer
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("agent") / "model"
    cmd = [sys.executable, "-m", "experiments.train_agent_model", "--out", str(out), "--minutes", "0.35",
           "--device", "cpu", "--shape", "tiny", "--seq-len", "1024", "--batch-tokens", "2048", "--workers", "1",
           "--threads", "1", "--eval-turns", "2", "--eval-every", "5", "--ckpt-every", "8", "--log-every", "3",
           "--warmup-steps", "5", "--lr", "3e-3", "--no-wandb"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_tiny_run_writes_a_flat_hf_checkpoint(trained):
    names = sorted(p.name for p in trained.iterdir())
    assert names == ["config.json", "generation_config.json", "loss.png", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "train_log.json"]
    log = json.loads((trained / "train_log.json").read_text())
    assert log["final"] and log["state"]["step"] > 0 and log["evals"]
    assert json.loads((trained / "config.json").read_text())["model_type"] == "llama"
    assert (trained.with_name(trained.name + ".resume.pt")).is_file()


def test_engine_transformers_and_trainer_logits_match(trained):
    from transformers import AutoModelForCausalLM

    eng = Engine.from_pretrained(trained, page_size=16, num_pages=256)
    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    ours = TrainLlama(json.loads((trained / "config.json").read_text()))
    load_hf_weights(ours, trained)
    ours.eval()
    tok = Tokenizer.from_dir(trained)
    turn = D.eval_turns(1, D.Renderer(tok), 1024)[0]
    chat = tok.apply_chat_template(turn.messages, tools=turn.tools)[:300]
    rand = torch.randint(0, tok.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    for ids in (chat, rand):
        with eng.session() as s:
            engine_logits = s.append(ids, all_logits=True)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([ids])).logits[0].float()
            trainer_logits = ours(torch.tensor([ids]))[0].float()
        torch.testing.assert_close(engine_logits, hf_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(trainer_logits, hf_logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_default_tokenizer(tmp_path_factory.mktemp("tok")))


def test_heldout_names_never_reach_training_rows(tok):
    split = D.default_split()
    assert len(split.tool_cores) >= 20 and len(split.args) >= 10
    # The evaluation turns call held-out tools only, so this test is not vacuous.
    turns = D.eval_turns(6, D.Renderer(tok), 2048, split)
    names = {c["name"] for t in turns for c in t.reference}
    assert names and all(split.heldout_tool(n) for n in names)
    maker = D.RowMaker(tok, 2048, seed=3, split=split)
    text = []
    for i in range(24):
        ids, codes = maker.row(0.25)
        assert len(ids) == len(codes) == 2049
        text.append(tok.decode(ids.tolist()))
    text = "\n".join(text)
    assert maker.stats["examples"] > 0
    assert split.leaks(text) == []
    for n in names:
        assert n not in text
    # The filter itself removes the names: the last-resort guard rarely has to.
    assert maker.stats["guard_dropped"] <= max(1, maker.stats["examples"] // 20)
    assert "<tool_call>" in text


def test_segmented_tokenization_equals_whole(tok):
    r = D.Renderer(tok)
    turn = D.eval_turns(1, r, 4096)[0]
    messages = turn.messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": x["name"], "arguments": json.dumps(x["arguments"])}}
        for x in turn.reference]}]
    ids, codes = r.tokens(messages, turn.tools)
    assert ids == tok.encode(r.render(messages, turn.tools))
    reply = tok.decode([i for i, c in zip(ids, codes) if c == D.ASSISTANT])
    assert reply == turn.reply_text + "<|im_end|>"


def test_eval_script_runs_through_the_engine(trained):
    from experiments.eval_agent_model import evaluate, report

    res = evaluate(str(trained), n_turns=1, max_tokens=8, time_limit=None, seq_len=2048, progress=False)
    assert res["turns"] == 1 and res["speculation"]["identical_outputs"]
    assert set(res["metrics"]["all"]) >= {"valid_json", "right_tool", "exact_args"}
    assert "speculation" in report(res)
