"""Request and response bodies of the Responses API (POST /v1/responses), in OpenAI's shapes.

Requests are strict and closed, as the chat schemas are. Input items are
messages (a `type` of "message" or none, as OpenAI's "easy" messages),
`function_call` items (echoed back by the client) and `function_call_output`
items; other item types (reasoning, item references, ...) are a 400.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from engine.api.schemas import CacheSalt, RequestBody

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ContentPart(RequestBody):
    # Assistant messages echoed back carry output_text parts, with their annotations.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON, as OpenAI sends it
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str
    id: str | None = None
    status: ItemStatus | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    ],
    Discriminator(_item_type),
]


class FunctionTool(RequestBody):
    """A function tool in the Responses API's flat shape (no nested "function")."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class ResponsesRequest(RequestBody):
    model: str
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    # "required" and a named function are offered to the model but not enforced (see chat.py).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # An extra sampling field, as vLLM accepts it: generate past EOS (benchmarks).
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


# Responses.


class ResponseBody(BaseModel):
    pass


class OutputText(ResponseBody):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(ResponseBody):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(ResponseBody):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Union[OutputMessage, OutputFunctionCall]


class InputTokensDetails(ResponseBody):
    cached_tokens: int  # prompt tokens whose KV was already held
    cache_write_tokens: int  # prompt tokens whose KV this request computed


class OutputTokensDetails(ResponseBody):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseBody):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseBody):
    reason: Literal["max_output_tokens"]


class TextFormat(ResponseBody):
    type: Literal["text"] = "text"


class TextConfig(ResponseBody):
    format: TextFormat = Field(default_factory=TextFormat)


class Response(ResponseBody):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    previous_response_id: str | None
    tools: list[FunctionTool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    store: bool
    metadata: dict[str, str]
    user: str | None = None
    text: TextConfig = Field(default_factory=TextConfig)


class ResponseDeleted(ResponseBody):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[dict]
    first_id: str | None
    last_id: str | None
    has_more: bool
