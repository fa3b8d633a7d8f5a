"""The engine: sessions, the scheduler, the turn, the runner; engine/api is its
OpenAI-compatible HTTP front.
"""

if __name__ == "engine":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
