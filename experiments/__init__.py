"""Benchmarks, workloads, peers and the default model's build (see each module's docstring)."""

if __name__ == "experiments":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
