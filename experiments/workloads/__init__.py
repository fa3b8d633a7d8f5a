"""What the benchmarks and the default model's data replay.

  workflows    seeded, generated multi-agent tool-calling workflows (its pools
               of words and templates in data/workloads.json)
  live_replay  a workflow whose assistant messages are the model's own
  agent_runs   many agents at once, each pausing while its tools run: the
               workload and its runner
"""
