"""Request and response bodies of the Responses API (POST /v1/responses), in OpenAI's shapes.

Requests are strict and closed, as the chat schemas are. Input items are
messages (a `type` of "message" or none, as OpenAI's "easy" messages),
`function_call` items (echoed back by the client) and `function_call_output`
items; other item types (reasoning, item references, ...) are a 400. The
request's other fields are of the kinds engine.api.schemas.ServingOptions
describes: implemented, refused but at their neutral value, or ignored with
the reason given where each is declared.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from agentkv.engine.api.schemas import (
    CacheSalt,
    JSONObjectFormat,
    JSONSchemaSpec,
    Metadata,
    PromptCacheOptions,
    ReasoningEffort,
    RequestBody,
    ServingOptions,
    TextFormat,
    Verbosity,
    first_refused,
)

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


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


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


class JSONSchemaTextFormat(JSONSchemaSpec):
    """text.format json_schema: chat's json_schema spec on the format itself."""

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class TextConfig(RequestBody):
    # Held to a grammar, as chat's response_format is (engine.structured).
    format: Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaTextFormat], Field(discriminator="type")] = Field(
        default_factory=lambda: TextFormat(type="text"))
    # Ignored: a hint to OpenAI's models that this model has no control for.
    verbosity: Verbosity | None = None


ReasoningSummary = Literal["auto", "concise", "detailed"]


class Reasoning(RequestBody):
    # Ignored, all of it: the model does not reason (it writes no reasoning
    # tokens and no reasoning items).
    effort: ReasoningEffort | None = None
    summary: ReasoningSummary | None = None
    generate_summary: ReasoningSummary | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


def _no_logprobs(include: list[str]) -> list[str]:
    if "message.output_text.logprobs" in include:
        raise PydanticCustomError("unsupported_parameter", "message.output_text.logprobs: this server returns no logprobs")
    return include


class ResponsesPromptCacheOptions(PromptCacheOptions):
    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: str | None = None  # ignored: it asks OpenAI for cache diagnostics
    prewarm: bool | None = None  # refused when true: this API always generates


class ResponsesStreamOptions(RequestBody):
    include_obfuscation: bool | None = None  # ignored, as chat's (StreamOptions)


class BackgroundOptions(RequestBody):
    # Ignored: they schedule background execution, which is refused.
    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: str | None = None


class ImageOptions(RequestBody):
    # Ignored: no image reaches this text-only model.
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


class AccessPrograms(RequestBody):
    # Ignored: OpenAI's access programs choose among its models' policies; here every request gets the one model.
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class ResponsesRequest(ServingOptions):
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
    stream_options: ResponsesStreamOptions | None = None
    metadata: Metadata | None = None
    user: str | None = None  # echoed; otherwise ignored as prompt_cache_key and safety_identifier are
    # "auto" drops the conversation's oldest items until the prompt and
    # max_output_tokens fit the context; "disabled" (the default) is a 413 then.
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: Reasoning | None = None
    # What they would add comes from built-in tools, image inputs and
    # reasoning items, none of which exist here: ignored; logprobs a 400.
    include: Annotated[list[Includable], AfterValidator(_no_logprobs)] | None = None
    # Ignored: it caps calls to OpenAI's built-in tools, none of which exist
    # here (function calls are the client's to run).
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    prompt_cache_options: ResponsesPromptCacheOptions | None = None
    background_options: BackgroundOptions | None = None
    image: ImageOptions | None = None
    access_programs: AccessPrograms | None = None
    # Refused when set: background runs, the Conversations API, stored
    # prompt templates and compaction are not served (a conversation is
    # chained with previous_response_id).
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    context_management: list | None = None
    # An extra sampling field, as vLLM accepts it: generate past EOS (benchmarks).
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None

    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def response_format(self) -> dict | None:
        """text.format as engine.structured reads a response_format; None for plain text."""
        fmt = self.text.format
        return None if isinstance(fmt, TextFormat) else fmt.model_dump(exclude_none=True)

    def unsupported(self) -> str | None:
        return first_refused({
            "top_logprobs": bool(self.top_logprobs),
            "background": bool(self.background),
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "context_management": bool(self.context_management),
            "prompt_cache_options": bool(self.prompt_cache_options and self.prompt_cache_options.prewarm),
        }) or ServingOptions.unsupported(self)


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
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Reasoning | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    background: bool = False
    service_tier: Literal["default"] = "default"  # the tier that served it: the only one
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None


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
