"""The KV cache: the page pool, block tables, the radix prefix cache and the host/disk tiers."""

if __name__ == "cache":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
