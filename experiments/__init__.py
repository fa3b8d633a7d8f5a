"""Experiments, by role (see each subpackage's and module's docstring):

  default_model  the default model's build: training, its data, evaluation,
                 the tokenizer's training
  workloads      generated multi-agent workflows, live replay, many agents at once
  drivers        the systems the benchmarks drive; drivers/peers/ the scripts
                 that run inside the peers' own venvs
  benchmarks     the benchmarks, the ablation and the demo
  common         shared by all: model shapes, the systems flag, run folders, the machine
  report         shared by all: the one writer of tables, JSON, PNGs and wandb runs
"""

if __name__ == "experiments":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
