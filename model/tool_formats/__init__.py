"""One module per tool-call format; agentkv.model.tool_calls picks among them."""
