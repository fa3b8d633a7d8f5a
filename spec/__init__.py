"""Speculation: the drafters (prompt lookup, suffix trees, schema phrases) and
their adaptive draft length.
"""

if __name__ == "spec":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
