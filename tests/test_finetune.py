"""The real model's fine-tune script (experiments/default_model/finetune.py)
end to end on a tiny GGUF base: it trains, keeps the adapter of its best
held-out evaluation, resumes from its checkpoint where it stopped (the step
count goes on, the data does not repeat), and what it writes loads as a model
whose chat template is the project's."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from agentkv.experiments.default_model import finetune  # noqa: E402
from agentkv.experiments.default_model.tokenizer import CHAT_TEMPLATE  # noqa: E402
from agentkv.model.loader import load_model, load_tokenizer  # noqa: E402
from tests.gguf_files import random_llama, write_gguf  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ["--seq-len", "256", "--rows", "2", "--rank", "2", "--eval-turns", "4", "--eval-task-turns", "4",
        "--log-every", "0", "--no-wandb", "--threads", "1", "--final-reserve", "3"]


def test_trains_keeps_the_best_adapter_and_resumes(tmp_path):
    base = write_gguf(random_llama(tied=True), tmp_path / "base.gguf", "Q8_0")
    out = tmp_path / "adapter"
    # Step caps, not the clock, end both runs: a loaded CI host must not make a run of 0 steps.
    assert finetune.main(["--base", str(base), "--out", str(out), "--max-steps", "3", *ARGS]) == 0
    first = json.loads((out / "train_log.json").read_text())
    assert first["state"]["step"] == 3 and first["final"] and first["history"]
    assert len(first["evals"]) >= 2  # the base's figures, then the final one
    assert (out / "loss.png").is_file() and (out / "resume.pt").is_file()
    assert finetune.main(["--base", str(base), "--out", str(out), "--max-steps", "5", "--resume", *ARGS]) == 0
    second = json.loads((out / "train_log.json").read_text())
    assert second["state"]["step"] == 5 and second["state"]["runs"] == 2
    # Without resume.pt (it is not committed): from the adapter kept and its log, a new optimizer.
    (out / "resume.pt").unlink()
    assert finetune.main(["--base", str(base), "--out", str(out), "--max-steps", "7", "--resume", *ARGS]) == 0
    third = json.loads((out / "train_log.json").read_text())
    assert third["state"]["step"] == 7 and third["state"]["runs"] == 3
    assert len(third["history"]) > len(second["history"]) and len(third["evals"]) >= len(second["evals"]) + 2
    with pytest.raises(SystemExit, match="rank"):
        finetune.main(["--base", str(base), "--out", str(out), "--max-steps", "8", "--resume", *ARGS[:4],
                       "--rank", "4", *ARGS[6:]])
    model = load_model(out, "float32")
    assert model.cfg.hidden_size == 64
    assert load_tokenizer(out).chat_template == CHAT_TEMPLATE
