"""What every system serves and returns. A system replays a workflow turn
by turn: begin() starts a pass from empty caches, turn(request) serves one
request and returns its row (turn_row), end() finishes the pass, close()
frees everything."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parents[2]
# Where peers (vLLM, llama.cpp) run: outside the checkout, whose top-level
# folders (model/, kernels/, ...) would shadow their own imports of those
# names from the working directory (vLLM's `python -m` subprocesses put it on
# sys.path).
PEER_CWD = Path(tempfile.gettempdir())


@dataclass
class Request:
    """One turn of a workflow, rendered once for every system."""

    index: int
    agent: str
    agent_turn: int
    messages: list[dict]
    tools: list[dict]
    ids: list[int]  # the prompt, rendered with the project's chat template
    gen: int  # tokens to generate
    reply_tokens: int  # tokens of the reference reply


@dataclass
class WireTurn:
    """One turn as a client sends it over the wire after the model's last
    reply in its conversation."""

    request: Request  # the reference turn: agent, prompt ids, tokens to generate
    items: list[dict]  # the new items, as the Responses API is sent them
    messages: list[dict]  # the same, as chat messages
    tools: list[dict]  # chat completions' shape


class System(Protocol):
    name: str
    info: dict  # what it reports about itself (sizes, versions, start-up time)

    def begin(self) -> None: ...

    def turn(self, r: Request) -> dict: ...

    def end(self) -> None: ...

    def close(self) -> None: ...


def turn_row(latency: float, prefill: float | None = None, decode: float | None = None, computed: int | None = None,
             reused: int | None = None, generated: int | None = None, **extra) -> dict:
    return {"latency_s": latency, "prefill_s": prefill, "decode_s": decode, "computed": computed, "reused": reused,
            "generated": generated, **extra}


def kv_tokens_needed(reqs: list[Request]) -> int:
    """Tokens of KV held at once if every agent's longest context stays resident."""
    per_agent: dict[str, int] = {}
    for r in reqs:
        per_agent[r.agent] = max(per_agent.get(r.agent, 0), len(r.ids) + r.gen)
    return sum(per_agent.values())


def rel(path: Path) -> str:
    """A path as the repository root sees it, for messages."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)
