"""The default model's build: what made models/agent-8m, one module a step.

  tokenizer  the byte-level BPE and its chat template, trained from a seeded
             corpus (the engine only loads the files it writes, through
             model/tokenizer.py)
  data       training rows (windows of generated workflows, task episodes,
             synthetic copies) and held-out turns
  tasks      short task episodes (plainly worded calls, answers, hand-offs)
  data_alt   a second, independent generator of evaluation turns
  train      the training run (python -m agentkv.experiments.default_model.train)
  eval       the held-out evaluation (python -m agentkv.experiments.default_model.eval)
"""
