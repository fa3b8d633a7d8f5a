"""The agent model's training script end to end (a CPU smoke run of some
20 s: a tiny model.llama.Transformer, a few steps, a sharded export): its
checkpoint loads in our engine and in transformers with matching logits, the
evaluation runs on it, and its data never shows a held-out tool or argument
name to training."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from agentkv import Engine
from agentkv.experiments.default_model import data as D
from agentkv.experiments.default_model import episodes as E
from agentkv.experiments.default_model import function_tasks as F
from agentkv.experiments.default_model import tasks as T
from agentkv.experiments.default_model.data_alt import alt_episodes
from agentkv.experiments.default_model.tokenizer import build_default_tokenizer
from agentkv.model.dense_forward import dense_hidden, dense_logits
from agentkv.model.loader import load_model
from agentkv.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> tuple[Path, Path]:
    """The prepared GPU command (profiling/train_gpu.sh) on the CPU with a tiny
    model: (its result folder, the resumable checkpoint)."""
    base = tmp_path_factory.mktemp("agent")
    out, work = base / "out", base / "work"
    env = {**os.environ, "DEVICE": "cpu", "MINUTES": "0.35", "SHAPE": "tiny", "EVAL_LIMIT": "3", "EVAL_TIMEOUT": "60",
           "EVAL_THREADS": "1", "WORK": str(work), "PYTHON": sys.executable}
    # --max-shard-mb 0.6: the tiny model's 0.67 MB go to two shards, as a bigger model's 49 MB go to four.
    args = ["--seq-len", "1024", "--batch-tokens", "2048", "--workers", "1", "--threads", "1", "--eval-turns", "2",
            "--eval-task-turns", "8", "--eval-every", "5", "--ckpt-every", "8", "--log-every", "3",
            "--warmup-steps", "5", "--lr", "3e-3", "--max-shard-mb", "0.6", "--no-wandb"]
    # 300 s: on a fresh machine the script compiles the C++ kernels before its eval.
    proc = subprocess.run(["bash", "profiling/train_gpu.sh", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stdout
    return out, Path(f"{work}.resume.pt")


@pytest.fixture(scope="module")
def trained(gpu_run, tmp_path_factory) -> Path:
    """The GPU run's results unpacked into a model folder, as its header says."""
    out, _ = gpu_run
    model = tmp_path_factory.mktemp("unpacked") / "model"
    model.mkdir()
    for shard in out.glob("model*.safetensors"):
        shutil.copy(shard, model)
    with tarfile.open(out / "meta.tar.gz") as tar:
        tar.extractall(model, filter="data")
    return model


@pytest.mark.slow
def test_gpu_command_returns_few_small_files(gpu_run):
    out, ckpt = gpu_run
    names = sorted(p.name for p in out.iterdir())
    assert names == ["meta.tar.gz", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # The limit counts tensor bytes; each file's JSON header adds a few kB.
    assert all((out / n).stat().st_size <= 0.6e6 + 16384 for n in names)
    assert ckpt.is_file()


@pytest.mark.slow
def test_tiny_run_writes_a_flat_sharded_hf_checkpoint(trained):
    names = sorted(p.name for p in trained.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) == 2 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert sorted(set(names) - set(shards)) == ["config.json", "eval.json", "generation_config.json", "loss.png",
                                               "model.safetensors.index.json", "tokenizer.json",
                                               "tokenizer_config.json", "train_log.json"]
    assert (trained / "loss.png").read_bytes()[:4] == b"\x89PNG"
    log = json.loads((trained / "train_log.json").read_text())
    assert log["final"] and log["state"]["step"] > 0 and len(log["evals"]) >= 2
    # The export is the evaluation that scored best, and the log says which.
    best = log["best"]
    scores = [[e["all"]["exact_args"], e["all"]["token_acc"]] for e in log["evals"]]
    assert best["score"] == max(scores) and best["weights"] == shards
    assert best["step"] == log["evals"][scores.index(max(scores))]["step"]
    assert json.loads((trained / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((trained / "eval.json").read_text())["turns"] > 0


@pytest.mark.slow
def test_engine_transformers_and_trainer_logits_match(trained):
    from transformers import AutoModelForCausalLM

    eng = Engine.from_pretrained(trained, dtype="float32", page_size=16, num_pages=256)
    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    ours = load_model(trained, "float32")  # the training forward, on the weights the loader reads back
    tok = Tokenizer.from_dir(trained)
    turn = D.eval_turns(1, D.Renderer(tok), 1024)[0]
    chat = tok.apply_chat_template(turn.messages, tools=turn.tools)[:300]
    rand = torch.randint(0, tok.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    for ids in (chat, rand):
        with eng.session() as s:
            engine_logits = s.append(ids, all_logits=True)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([ids])).logits[0].float()
            trainer_logits = dense_logits(ours, dense_hidden(ours, torch.tensor([ids])))[0].float()
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


@pytest.mark.slow
def test_eval_script_runs_through_the_engine(trained):
    from agentkv.experiments.default_model.eval import SETS, eval_set, evaluate, report

    tok = Tokenizer.from_dir(trained)
    turns = eval_set(D.Renderer(tok), D.load_split(trained), 2048, 2, SETS, 8)
    # One turn of each set and kind, and one with no tools offered.
    pick = {}
    for t in turns:
        pick.setdefault((t.source, t.kind), t)
    res = evaluate(str(trained), n_turns=0, max_tokens=8, time_limit=None, seq_len=2048, progress=False,
                   turns=list(pick.values()))
    assert res["turns"] == len(pick) >= 7 and res["speculation"]["identical_outputs"]
    m = res["metrics"]
    assert m["calls"]["turns"] and m["alt calls"]["turns"] and m["answers"]["turns"] and m["no tools offered"]["turns"]
    assert set(m["calls"]) >= {"valid_json", "right_tool", "exact_args"} and "final_answer" in m["answers"]
    assert sum(b["values"] for b in res["copy_by_position"].values()) > 0
    text = report(res)
    assert "speculation" in text and "final answer" in text and "issue 40" in text


def test_task_episodes_keep_heldout_names_out_of_training(tok):
    split = D.default_split()
    held = T.heldout_task_args()
    assert len(held) >= 30 and held <= split.args
    maker = D.RowMaker(tok, 2048, seed=5, split=split)
    r = maker.rng
    kinds, placements = set(), set()
    for _ in range(300):
        ep = E.training_episode(r, maker.allowed)
        kinds.add(ep.kind)
        placements.add(ep.placement)
        text = json.dumps(ep.messages) + json.dumps(ep.tools)
        assert not held & set(D._WORD.findall(text))
        assert not any(f in text for f in F.heldout_functions())
    assert kinds == set(E.KINDS) and placements >= set(T.PLACEMENTS)
    # The held-out task turns do use them, and every kind is there.
    turns = D.task_eval_turns(D.Renderer(tok), 4096, split)
    assert len(turns) >= 120 and {t.kind for t in turns} == set(E.KINDS)
    calls = [t for t in turns if t.kind == "call"]
    assert sum(t.heldout_args > 0 for t in calls) >= len(calls) // 3
    assert {t.style for t in calls} >= set(T.PLACEMENTS)


def test_reference_values_are_in_the_prompt(tok):
    """Every call's values and every looked-up answer's values can be copied
    from the prompt: the references are defined by the context, in both
    generators."""
    r = D.Renderer(tok)
    turns = D.task_eval_turns(r, 4096) + [D.episode_turn(ep, r, k, "alt") for k, ep in enumerate(alt_episodes(40))]
    for t in turns:
        prompt = r.render(t.messages, t.tools or None, True)
        for call in t.reference:
            for v in call["arguments"].values():
                if isinstance(v, bool):  # a flag is worded ("with its recent history")
                    continue
                shown = v if isinstance(v, str) else ", ".join(map(str, v)) if isinstance(v, list) else json.dumps(v)
                assert shown in prompt, (t.kind, t.style, v)
        if t.kind not in ("plain", "unfit"):  # answers without a tool are computed (a sum, a count, a sorted list)
            for v in t.answer_values:
                assert v in prompt, (t.kind, v)
        assert ("<tool_call>" in t.reply_text) == bool(t.reference)
        if t.kind == "plain":
            assert not t.tools


def test_unfit_requests_get_no_call_and_parallel_requests_get_every_call():
    """A request no offered tool fits is answered in text, and where it asks
    for a record action, no offered tool has both its action and its record
    kind; a request naming several records gets one call per record, in order."""
    r = __import__("random").Random(11)
    for _ in range(200):
        ep = T.unfit_episode(r, lambda a: True, frozenset())
        assert ep.kind == "unfit" and ep.tools and not ep.reference() and ep.reply["content"]
        assert ep.placement in ("record", "off_domain")
        if ep.placement == "record":  # a record action: the reply names it ("... cancel a ticket ...")
            entity = ep.answer_values[0]
            asked = [v for v in T.VERBS if f"{v} a {entity}" in ep.reply["content"]]
            assert len(asked) == 1 and entity in ep.messages[-2]["content"]
            fitting = {f"{asked[0]}_{entity}", f"{entity}_{asked[0]}", f"{asked[0]}{entity.title()}"}
            assert not fitting & {t["function"]["name"] for t in ep.tools}
        ep = T.parallel_episode(r, lambda a: True, frozenset())
        calls = ep.reference()
        assert ep.kind == "parallel" and len(calls) >= 2
        values = [next(iter(c["arguments"].values())) for c in calls]
        positions = [ep.messages[-2]["content"].find(v) for v in values]
        assert min(positions) >= 0 and positions == sorted(positions)
        assert {c["name"] for c in calls} <= {t["function"]["name"] for t in ep.tools}

def test_alt_generator_shares_no_tool_or_argument_name_with_training():
    train_names = {f"{v}_{e}" for v in T.VERBS for e in T.ENTITIES} | T.task_arg_names() | D._all_param_names()
    train_names |= {n for names in D._all_tool_cores().values() for n in names}
    alt = alt_episodes(200)
    assert {e.kind for e in alt} == {"call", "answer"}
    names = {t["function"]["name"] for e in alt for t in e.tools}
    args = {a for e in alt for t in e.tools for a in t["function"]["parameters"]["properties"]}
    assert names and args and not (names | args) & train_names


@pytest.mark.slow
def test_eval_turns_are_the_same_in_every_process():
    """The held-out sets are a fixed benchmark: nothing in them may depend on
    the process (set order follows the string hash seed)."""
    code = ("import hashlib, json; from agentkv.experiments.default_model import data as D, eval as E; "
            "from agentkv.model.tokenizer import Tokenizer; r = D.Renderer(Tokenizer.from_dir('models/agent-8m')); "
            "ts = E.eval_set(r, D.default_split(), 4096, 4, E.SETS, 256); "
            "print(hashlib.md5(json.dumps([[t.messages, t.tools, t.reply_text] for t in ts]).encode()).hexdigest())")
    # Both at once: each spends its ~4 s importing and building, on a core of its own where there are two.
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    digests = {out for out, _ in outs}
    assert len(digests) == 1 and len(next(iter(digests)).strip()) == 32
