"""The benchmarks, one module each (python -m agentkv.experiments.benchmarks.NAME;
each module's docstring says what it measures), with:

  ablate      sessions x radix prefix cache x speculation, side by side
  demo        the main job, in-process (python serve.py demo)
  eval_bfcl   function-calling accuracy on BFCL v4 through any OpenAI server
  proc_usage  who used the CPUs while a benchmark timed something

Their shared plumbing is experiments.common and experiments.report.
"""
