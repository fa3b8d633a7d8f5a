"""What the benchmarks and the default model's data replay.

  workflows    seeded, generated multi-agent tool-calling workflows (its pools
               of words and templates in data/workloads.json)
  live_replay  a workflow whose assistant messages are the model's own
  agent_runs   many agents at once, each pausing while its tools run: the
               workload and its runner
  bfcl         BFCL v4 (bfcl-eval): its entries, function docs as tools, the
               multi-turn loop on its executable classes and its checker
  bfcl_agents  BFCL's multi-turn conversations as many live agents at once
  agent_workload  which agents a many-agents run serves (BFCL's or generated),
               their KV budget and jobs: shared by the demo and bench_agents
"""
