"""Request and response bodies of the HTTP API, in OpenAI's shapes.

Requests are strict and closed (`extra="forbid"`): a wrong type or an unknown
field is a 400, as at OpenAI, rather than a silently ignored option. The one
extra fields are `session_id`, which pins a conversation to a persistent engine
session, and vLLM's `cache_salt`, which isolates the prefix cache of the
requests that carry it from those of the rest of their tenant. Fields OpenAI documents that this engine cannot honour yet are
accepted only at their neutral value (see `unsupported`).
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
# OpenAI allows up to 4 stop sequences.
Stop = Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]]
# OpenAI allows up to 16 pairs, keys of up to 64 characters, values of up to 512.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def first_refused(refused: dict[str, bool]) -> str | None:
    """The first of the fields named (in the order to report them) whose value this engine cannot honour."""
    return next((name for name, refuse in refused.items() if refuse), None)


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart]]


class FunctionCall(RequestBody):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(RequestBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(RequestBody):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(RequestBody):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(RequestBody):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(RequestBody):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


def template_message(message: Message) -> dict:
    """The message as chat templates read it: text parts joined, developer as system."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        out["content"] = "\n".join(part.text for part in message.content)
    if isinstance(message, SystemMessage):
        out["role"] = "system"
    if isinstance(message, AssistantMessage):
        out.pop("refusal", None)
    return out


class FunctionDefinition(RequestBody):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(RequestBody):
    model_config = ConfigDict(serialize_by_alias=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; the wire name stays "schema".
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(RequestBody):
    type: Literal["text"]


class JSONObjectFormat(RequestBody):
    type: Literal["json_object"]


class JSONSchemaFormat(RequestBody):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


class StreamOptions(RequestBody):
    include_usage: bool = False
    # Ignored: OpenAI pads stream events against a network side channel on
    # payload sizes; these events carry no padding field.
    include_obfuscation: bool | None = None


class PromptCacheOptions(RequestBody):
    # Ignored: breakpoints and lifetimes of OpenAI's prompt cache. Here every
    # token prefix is matched, and the retention policy and KV tiers decide
    # how long KV stays.
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class ServingOptions(RequestBody):
    """How OpenAI routes, bills and polices a request, shared by chat
    completions and the Responses API.

    Every field OpenAI documents for a request (as the `openai` client's
    types declare them) is implemented, refused at any but its neutral value
    (a 400 naming it, see `unsupported`), or accepted and ignored where what
    OpenAI does with it has no counterpart here; each ignored field says why
    where it is declared. These are all ignored but moderation."""

    # Ignored: OpenAI routes requests with one key to one cache machine;
    # here every request is matched against every cached prefix of its namespace.
    prompt_cache_key: str | None = None
    # Ignored: how long OpenAI keeps cached prefixes (see PromptCacheOptions).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # Ignored: it identifies an end user to OpenAI's abuse detection.
    safety_identifier: Annotated[str, Field(max_length=128)] | None = None
    # Ignored: there is one processing tier here, which replies name ("default").
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    # Refused when set: no moderation model runs here, and serving the
    # request unmoderated is not what was asked for.
    moderation: dict | None = None

    def unsupported(self) -> str | None:
        return "moderation" if self.moderation is not None else None


class Sampling(RequestBody):
    """What chat and text completions share. temperature defaults to 1.0, as at OpenAI."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: Stop | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # An extra sampling field, as vLLM accepts it: generate past EOS (benchmarks).
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None
    # vLLM's and SGLang's own fields, which vllm-router (engine.api.cluster) writes into every chat and
    # text completion it forwards, at these values; refused at any other (see unsupported), but for
    # the reasoning ones, ignored: the model does not reason.
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> str | None:
        """The first option set to something this engine cannot do, if any."""
        if self.n != 1:
            return "n"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.presence_penalty:
            return "presence_penalty"
        return first_refused({"no_stop_trim": self.no_stop_trim, "skip_special_tokens": not self.skip_special_tokens,
                              "return_hidden_states": self.return_hidden_states,
                              "continue_final_message": self.continue_final_message})


class Prediction(RequestBody):
    type: Literal["content"]
    content: Content


class ChatCompletionRequest(Sampling, ServingOptions):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    # Enforced by a grammar (engine.structured): "required" and a named
    # function always yield calls to offered tools with schema-valid arguments.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Ignored: at OpenAI, metadata tags and store keeps a completion for its
    # evals and distillation products; chat completions are not stored here.
    metadata: Metadata | None = None
    store: bool | None = None
    # Ignored: a prediction only makes OpenAI's reply faster, never different
    # (speculation here drafts from the conversation itself).
    prediction: Prediction | None = None
    # Ignored: a hint to OpenAI's models that this model has no control for.
    verbosity: Verbosity | None = None
    # Ignored: the model does not reason (it writes no reasoning tokens).
    reasoning_effort: ReasoningEffort | None = None
    # Only text: the model has no audio output.
    modalities: list[Literal["text", "audio"]] | None = None
    # Refused when set: no audio output, no web search; the deprecated
    # functions and function_call are tools and tool_choice here.
    audio: dict | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    # Refused when not empty: the sampler applies no logit bias.
    logit_bias: dict[str, int] | None = None
    session_id: SessionId | None = None

    def unsupported(self) -> str | None:
        return first_refused({
            "logprobs": self.logprobs,
            "top_logprobs": bool(self.top_logprobs),
            "modalities": "audio" in (self.modalities or ()),
            "audio": self.audio is not None,
            "web_search_options": self.web_search_options is not None,
            "functions": self.functions is not None,
            "function_call": self.function_call is not None,
            "logit_bias": bool(self.logit_bias),
        }) or Sampling.unsupported(self) or ServingOptions.unsupported(self)


class CompletionRequest(Sampling):
    prompt: Union[str, Annotated[list[int], Field(min_length=1)]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for text completions
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.logprobs is not None:
            return "logprobs"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class SessionCreateRequest(RequestBody):
    session_id: SessionId | None = None
    cache_salt: CacheSalt | None = None


class TruncateRequest(RequestBody):
    length: Annotated[int, Field(ge=0)]


class RetainRequest(RequestBody):
    # Seconds from now the session's KV stays in the pool (a client that
    # knows how long its tool takes says so), at most the server's
    # max_retain_s; null: that maximum. A pin is always finite.
    seconds: Annotated[float, Field(ge=0)] | None = None


# Responses.


class ResponseBody(BaseModel):
    pass


class PromptTokensDetails(ResponseBody):
    cached_tokens: int


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class ResponseFunctionCall(ResponseBody):
    name: str
    arguments: str


class ResponseToolCall(ResponseBody):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatMessage(ResponseBody):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(ResponseBody):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(ResponseBody):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: Literal["default"] = "default"  # the tier that served it: the only one


class ChunkToolCall(ResponseToolCall):
    index: int


class Delta(ResponseBody):
    """What a stream chunk adds; only the keys it sets are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None

    @model_serializer(mode="wrap")
    def _set_keys_only(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(ResponseBody):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseBody):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: Literal["default"] = "default"


class CompletionChoice(ResponseBody):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(ResponseBody):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentkv"


class ModelList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TurnRecord(ResponseBody):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_s: float
    # Where the latency went (records saved by earlier servers have none).
    queued_s: float = 0.0  # waiting for admission (a program's place, a slot, pages)
    prefill_s: float = 0.0  # computing the prompt's KV
    decode_s: float = 0.0  # drawing the reply
    restored_tokens: int = 0  # prompt tokens whose KV came back from the host tier
    preemptions: int = 0


class SessionInfo(ResponseBody):
    id: str
    object: Literal["session"] = "session"
    length: int  # tokens whose KV the session holds (or will compute with its next step)
    pages: int
    busy: bool
    pinned: bool  # its KV stays in the pool unless nothing else can give way
    awaiting_tools: list[str] | None  # the tools its last turn called; null after a final answer
    tier_tokens: int  # tokens of its KV held in the second tier (host memory or disk)
    turns: list[TurnRecord]


class SessionList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[SessionInfo]
    reports: list[str]  # what resuming saved sessions found wrong: those sessions recompute
