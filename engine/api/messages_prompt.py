"""A Messages API prompt as the chat messages the chat completions route
renders, so that one conversation sent over either API is the same tokens
and a re-sent one continues the same held KV (engine.turn):

- `system` (a string or text blocks) is one system message first;
- a user message's text blocks are one user message, each tool_result a
  tool message (an error result's text after "Error: ": chat templates have
  no flag for it), in the blocks' order;
- an assistant message's text is its content, its tool_use blocks its
  tool_calls (arguments as JSON);
- tools are chat tools with input_schema as their parameters; tool_choice
  auto / any / tool / none is "auto" / "required" / the named function /
  "none", disable_parallel_tool_use is parallel_tool_calls false.

A tool_result must answer a tool_use of the assistant message just before
it (400 otherwise, as at Anthropic). Each cache_control marker becomes a
Breakpoint: the chat messages of the prompt up to the marked block, whose
rendering is the prefix to keep (engine.api.cache_pins).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from agentkv.engine import offered_tools, tool_choice_error
from agentkv.engine.api.errors import APIError
from agentkv.engine.api.messages_schemas import (
    MAX_BREAKPOINTS,
    Block,
    CacheControl,
    MessageParam,
    MessagesPrompt,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlock,
    ToolUseBlock,
)
from agentkv.engine.api.schemas import (
    AssistantMessage,
    FunctionCall,
    FunctionDefinition,
    Message,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
    template_message,
)


@dataclass(frozen=True)
class Breakpoint:
    messages: list[dict]  # the chat messages up to the marked block: their rendering is the prefix kept
    seconds: float  # its TTL


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]  # as chat templates read them
    all_tools: list[dict] | None  # as chat templates read them
    tool_choice: str | dict | None
    parallel_tool_calls: bool
    breakpoints: list[Breakpoint]

    @property
    def tools(self) -> list[dict] | None:
        """The tools the model is shown (none under tool_choice "none")."""
        return offered_tools(self.all_tools, self.tool_choice)


def chat_prompt(body: MessagesPrompt) -> ChatPrompt:
    """The body as a chat prompt; 400 for a malformed conversation or tool_choice."""
    tools = [_tool(t) for t in body.tools] if body.tools else None
    choice = _tool_choice(body)
    offered = [t.name for t in body.tools or ()]
    if (why := tool_choice_error(choice, offered)) is not None:
        raise APIError(400, why, param="tool_choice")
    system = _system(body.system)
    head = [template_message(system)] if system is not None else []
    marks: list[tuple[list[dict], CacheControl]] = []
    if body.tools and (tool_marks := [t.cache_control for t in body.tools if t.cache_control]):
        # The template writes every tool in one place: a marker on any keeps them all.
        marks.append((list(head), max(tool_marks, key=lambda c: c.seconds)))
    if isinstance(body.system, list):
        marks += [([template_message(_system(body.system[: i + 1]))], b.cache_control)
                  for i, b in enumerate(body.system) if b.cache_control]
    messages = list(head)
    for i, message in enumerate(body.messages):
        blocks = message.blocks()
        _check_results(body.messages, i)
        marks += [(messages + _chat_messages(message.role, blocks[: j + 1]), b.cache_control)
                  for j, b in enumerate(blocks) if b.cache_control]
        messages += _chat_messages(message.role, blocks)
    if body.cache_control is not None:
        marks.append((list(messages), body.cache_control))
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(400, f"a request may carry at most {MAX_BREAKPOINTS} cache_control markers, got {len(marks)}",
                       param="cache_control")
    breakpoints = [Breakpoint(prefix, control.seconds) for prefix, control in marks]
    given = body.tool_choice
    parallel = given is None or isinstance(given, ToolChoiceNone) or not given.disable_parallel_tool_use
    return ChatPrompt(messages, tools, choice, parallel, breakpoints)


def _tool(tool: ToolParam) -> dict:
    function = FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema)
    return Tool(type="function", function=function).model_dump(exclude_none=True)


def _tool_choice(body: MessagesPrompt) -> str | dict | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return "none" if isinstance(choice, ToolChoiceNone) else "auto"


def _system(system: str | list[TextBlock] | None) -> SystemMessage | None:
    if system is None or system == []:
        return None
    return SystemMessage(role="system", content=system if isinstance(system, str) else "\n".join(b.text for b in system))


def _check_results(messages: list[MessageParam], i: int) -> None:
    """400 unless each tool_result of message i answers a tool_use of the assistant message before it."""
    blocks = messages[i].blocks()
    before = messages[i - 1] if i > 0 and messages[i - 1].role == "assistant" else None
    asked = {b.id for b in before.blocks() if isinstance(b, ToolUseBlock)} if before is not None else set()
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, ToolResultBlock if messages[i].role == "assistant" else ToolUseBlock):
            raise APIError(400, f"{where}: a {block.type} block cannot be in a {messages[i].role} message", param=where)
        if isinstance(block, ToolResultBlock) and block.tool_use_id not in asked:
            raise APIError(400, f"{where}: tool_result for {block.tool_use_id!r}, but the message before it has no "
                           "tool_use with that id", param=where)


def _chat_messages(role: str, blocks: list[Block]) -> list[dict]:
    out: list[Message] = []
    if role == "assistant":
        text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                 for b in blocks if isinstance(b, ToolUseBlock)]
        out.append(AssistantMessage(role="assistant", content=text or None, tool_calls=calls or None))
    else:
        texts: list[str] = []
        for block in blocks:
            if isinstance(block, TextBlock):
                texts.append(block.text)
                continue
            if texts:
                out.append(UserMessage(role="user", content="\n".join(texts)))
                texts = []
            content = ("Error: " if block.is_error else "") + block.text()
            out.append(ToolMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
        if texts:
            out.append(UserMessage(role="user", content="\n".join(texts)))
    return [template_message(m) for m in out]
