"""The systems the benchmarks drive, one module a kind.

  system       the interface: a Request served turn by turn (begin, turn, end,
               close) and the row a turn returns
  replay       a workflow as the Requests every system replays
  checkpoint   a random-init model saved once in Hugging Face layout
  engine_local this engine in-process: stateful, stateless, block-hash
  engine_http  this engine over HTTP with the openai client: chat
               completions re-sending the history, the Responses API
  servers      an OpenAI-compatible server in a subprocess (this engine's
               serve.py) or in a thread of this process, and its /metrics
  peer         a peer in its own venv, served over JSON lines
  vllm         vLLM: offline (experiments/drivers/peers/vllm_driver.py) and its own
               OpenAI server
  llamacpp     llama.cpp through llama-cpp-python
  hf           HF transformers generate

peers/ holds what runs inside a peer's own venv, as a script by its path:
its setup (setup_vllm.sh, setup_llamacpp.sh), its driver (vllm_driver.py,
llamacpp_driver.py) and their JSON-lines protocol (peer_protocol.py). It is
not a package: a driver imports peer_protocol from beside it, and nothing of
the repository.
"""
