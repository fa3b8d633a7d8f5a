"""Request and response bodies of the Messages API, in Anthropic's shapes.

Requests are strict and closed, as Anthropic's are: a wrong type, an
unknown field or an unknown content block type is a 400. Blocks are text,
tool_use (assistant) and tool_result (user); images, documents, thinking
and server tools are not accepted. Fields with no counterpart here are
accepted and ignored where honouring them could not change the reply;
each says why where it is declared.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from agentkv.engine.api.schemas import RequestBody, ResponseBody

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
# Anthropic's limit on cache_control markers in one request.
MAX_BREAKPOINTS = 4


class CacheControl(RequestBody):
    """A cache breakpoint: the prompt up to the block that carries it is
    kept for the TTL (engine.api.cache_pins)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        return TTL_SECONDS[self.ttl]


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # Only as absent: citations come from documents, which are not accepted.
    citations: Annotated[list, Field(max_length=0)] | None = None


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class MessageParam(RequestBody):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolParam(RequestBody):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # Ignored: arguments are held to input_schema by a grammar whether or not it is set.
    strict: bool | None = None


class ToolChoiceAuto(RequestBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestBody):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestBody):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone], Field(discriminator="type")]


class Metadata(RequestBody):
    # Ignored: it identifies an end user to Anthropic's abuse detection.
    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesPrompt(RequestBody):
    """What a prompt is made of: all count_tokens takes."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    # A breakpoint on the last block of the last message.
    cache_control: CacheControl | None = None
    # Ignored: the model does not reason; replies carry no thinking blocks.
    thinking: dict | None = None


class MessagesRequest(MessagesPrompt):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    metadata: Metadata | None = None
    stream: bool = False
    # Ignored: there is one processing tier here, which usage names ("standard").
    service_tier: Literal["auto", "standard_only"] | None = None

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())


# Responses.


class TextContent(ResponseBody):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(ResponseBody):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


Content = Union[TextContent, ToolUseContent]


class CacheCreation(ResponseBody):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessagesUsage(ResponseBody):
    """input_tokens + cache_read_input_tokens + cache_creation_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    cache_creation: CacheCreation
    service_tier: Literal["standard"] = "standard"


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(ResponseBody):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Content]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(ResponseBody):
    input_tokens: int
