"""A workflow as the requests every system replays, teacher-forced: each
turn's whole history, rendered once with the project's chat template, and
as many tokens to generate as the reference reply has."""
from __future__ import annotations

from agentkv.experiments.drivers.system import Request
from agentkv.experiments.workloads.workflows import Workflow, six_turn_workflow, thirty_five_turn_workflow


def workflow(name: str, seed: int) -> Workflow:
    return {"6": six_turn_workflow, "35": thirty_five_turn_workflow}[name](seed)


def reply_token_count(tokenizer, request: list[dict], tools, reply: dict, prompt: list[int]) -> int:
    """Tokens of the reference assistant reply in the template: the full
    conversation rendered with the reply, less the prompt and the end marker."""
    full = tokenizer.apply_chat_template(request + [reply], tools=tools, add_generation_prompt=False)
    end = tokenizer.encode("<|im_end|>\n")
    if full[: len(prompt)] == prompt:
        return max(1, len(full) - len(prompt) - len(end))
    text = reply.get("content") or ""
    for call in reply.get("tool_calls") or []:
        fn = call["function"]
        text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
    return max(1, len(tokenizer.encode(text)))


def prepare_requests(tokenizer, wf: Workflow, max_turns: int | None, max_gen: int | None,
                     max_context: int | None = None) -> list[Request]:
    """The workflow's turns as requests; turns whose prompt and reply would not
    fit max_context (the model's positions) are left out, as every system
    would have to refuse them."""
    reqs = []
    for i, turn in enumerate(wf.turns()):
        if max_turns is not None and i >= max_turns:
            break
        ids = tokenizer.apply_chat_template(turn.request, tools=turn.tools, add_generation_prompt=True)
        n = reply_token_count(tokenizer, turn.request, turn.tools, turn.reply, ids)
        gen = min(n, max_gen) if max_gen else n
        if max_context is not None and len(ids) + gen > max_context:
            continue
        reqs.append(Request(i, turn.agent, turn.index, turn.request, turn.tools, ids, gen, n))
    return reqs
