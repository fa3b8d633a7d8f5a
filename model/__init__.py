"""The model: config, the hand-written Llama-family forward, loading,
tokenizer, chat template and tool calls, sampling.
"""

if __name__ == "model":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)
