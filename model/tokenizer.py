"""A Hugging Face tokenizer directory, read without transformers.

The token ids come from the `tokenizers` library (tokenizer.json); the chat
template is rendered with jinja2 in the same environment transformers builds
(`transformers.utils.chat_template_utils._cached_compile_jinja_template`), so
a model's template gives here the string and ids it gives there.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from agentkv.model.tool_calls import ToolCallFormat, format_of_template

__all__ = ["Tokenizer", "TokenizerError", "IncrementalDecoder", "render_chat_template"]

# The named special tokens transformers hands to every template as variables.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning is passed under; templates read the first, gpt-oss ones read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be read, or a chat template that cannot render."""


class _GenerationTag(jinja2.ext.Extension):
    # Training templates mark assistant spans with {% generation %}; transformers accepts the
    # tag, so a template using it must parse here too. Rendering keeps the body unchanged.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    # The sandbox checks reads, not `{% set ns._x = ... %}`; refusing underscore names keeps
    # templates away from CPython internals, as transformers does.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _with_mapping_arguments(call: Any) -> Any:
    """A tool call whose arguments, if a JSON string of an object, are that object."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    arguments = fn.get("arguments") if isinstance(fn, dict) else None
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        return call
    fn = {**fn, "arguments": value}
    return {**call, "function": fn} if "function" in call else fn


def _normalize_message(message: dict, mapping_arguments: bool) -> dict:
    if not isinstance(message, dict):
        raise TokenizerError(f"chat messages must be dicts, got {message!r}")
    # OpenAI clients send content=None or tool_calls=None; templates handle a missing key, not None.
    message = {key: value for key, value in message.items() if value is not None}
    if mapping_arguments and isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_with_mapping_arguments(call) for call in message["tool_calls"]]
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat_template(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    *,
    mapping_arguments: bool = False,
    **variables: Any,
) -> str:
    """Render `template` as transformers' apply_chat_template(tokenize=False) does.

    `tools` are OpenAI function dicts ({"type": "function", "function": {...}});
    `variables` are passed to the template as they are (special tokens, date_string, ...).
    mapping_arguments: tool calls' JSON-string arguments are given to the template
    parsed, as vLLM gives them (ToolCallFormat.mapping_arguments), not as sent.
    """
    if not messages:
        raise TokenizerError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise TokenizerError("tools must be JSON-schema dicts")
    messages = [_normalize_message(m, mapping_arguments) for m in messages]
    variables.setdefault("documents", None)
    try:
        compiled = _compile(template)
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
    # A template is untrusted code from a model directory: whatever it raises is its failure to render.
    except Exception as e:
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores a token either as its string or as a serialized AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict, special_tokens_map: dict | None) -> dict[str, str]:
    """The template variables transformers derives from the config: the named special
    tokens plus any model-specific `*_token` entry (e.g. Gemma's `image_token`)."""
    tokens = {}
    for key, value in config.items():
        content = _token_content(value)
        if content is not None and (key in _NAMED_SPECIAL_TOKENS or key.endswith("_token")):
            tokens[key] = content
    # transformers reads the legacy special_tokens_map.json only when the config lacks
    # added_tokens_decoder, and then lets it override the config.
    if special_tokens_map and "added_tokens_decoder" not in config:
        for key, value in special_tokens_map.items():
            content = _token_content(value)
            if content is not None:
                tokens[key] = content
    return tokens


def _chat_templates(path: Path, config: dict) -> dict[str, str]:
    # Standalone .jinja files take priority over templates in the config, as in transformers.
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    template_dir = path / "additional_chat_templates"
    if template_dir.is_dir():
        for file in sorted(template_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    configured = config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {entry["name"]: entry["template"] for entry in configured}
    return {}


class Tokenizer:
    """Text <-> ids for one model, and its chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_templates: dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_eos_token_ids: list[int] | None = None,
        max_new_tokens: int | None = None,
    ):
        self.backend = backend
        # generation_config.json's budget for one reply: the server's default max_tokens.
        self.max_new_tokens = max_new_tokens
        self.chat_templates = chat_templates or {}
        self.special_tokens = special_tokens or {}
        eos = self.special_tokens.get("eos_token")
        ids = ([self._required_id(eos)] if eos is not None else []) + list(extra_eos_token_ids or [])
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self._required_id(bos) if bos is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise TokenizerError(f"cannot load {tokenizer_file}: {e}") from e
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        map_file = path / "special_tokens_map.json"
        special_tokens_map = _read_json(map_file) if map_file.is_file() else None
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        eos_ids = generation.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        budget = generation.get("max_new_tokens")
        budget = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None
        return cls(backend, _chat_templates(path, config), _special_tokens(config, special_tokens_map), eos_ids,
                   budget)

    def with_chat_template(self, template: str) -> Tokenizer:
        """The same tokenizer with template as its only chat template."""
        return Tokenizer(self.backend, {"default": template}, self.special_tokens, self.eos_token_ids,
                         self.max_new_tokens)

    def _required_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"special token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens(self) -> dict[int, str]:
        """The added tokens (id -> text), which the tokenizer splits on before anything else."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @cached_property
    def tool_call_format(self) -> ToolCallFormat:
        """How the model writes tool calls, as its tool-use template teaches."""
        return format_of_template(self.chat_templates.get("tool_use") or self.chat_template)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as written: no BOS or EOS is added (chat templates write their own)."""
        # The batch call releases the GIL while it encodes (encode holds it): a
        # long prompt tokenizing on a request's thread must not stop the scheduler's.
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def tool_markers(self) -> dict[int, str]:
        """The special tokens (id -> text) that are markup of the template's
        tool-call format (Mistral's [TOOL_CALLS]), which a reply's text keeps."""
        wanted = set(self.tool_call_format.special_markers)
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()
                if t.special and t.content in wanted}

    def decode_reply(self, ids: list[int], keep: dict[int, str]) -> str:
        """decode(ids, skip_special_tokens=True), but with the tokens in keep written as their text."""
        if not keep:  # most formats keep none: no pass over the reply in Python
            return self.decode(ids, skip_special_tokens=True)
        pieces, start = [], 0
        for i, token in enumerate(ids):
            if token in keep:
                pieces += [self.decode(ids[start:i], skip_special_tokens=True), keep[token]]
                start = i + 1
        return "".join(pieces) + self.decode(ids[start:], skip_special_tokens=True)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int] | str:
        """The prompt for `messages`, as ids (or the string with tokenize=False).

        `chat_template` is a template name ("tool_use", ...) or a template; by
        default the model's, its "tool_use" variant when tools are given.
        `kwargs` become template variables and override the special tokens.
        """
        template = self._template(chat_template, tools)
        text = render_chat_template(
            template, messages, tools, add_generation_prompt,
            mapping_arguments=format_of_template(template).mapping_arguments, **{**self.special_tokens, **kwargs},
        )
        return self.encode(text) if tokenize else text

    def _template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise TokenizerError(f"several chat templates and no default: pick one of {sorted(self.chat_templates)}")
        raise TokenizerError("this tokenizer has no chat template")


class IncrementalDecoder:
    """Streams text as token ids arrive, never emitting a partial UTF-8 character.

    The concatenation of every push() and the final flush() equals
    tokenizer.decode(all ids) (decode_reply with `keep`): the library holds back a token whose bytes do not
    yet complete a character; flush() gives out what is still held at the end
    of the stream (bytes that never became valid UTF-8 decode to U+FFFD there).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, keep: dict[int, str] | None = None):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._keep = keep or {}  # special tokens written as their text all the same (Tokenizer.decode_reply)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # since the last kept token
        self._emitted = 0  # characters of them given out so far

    def push(self, token_id: int) -> str:
        if token_id in self._keep:
            # decode_reply decodes the ids between kept tokens apart: so does the stream.
            text = self.flush() + self._keep[token_id]
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._ids, self._emitted = [], 0
            return text
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer.backend, token_id) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """What the held-back tokens decode to; call once, when the stream has ended."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)[self._emitted:]
        self._emitted += len(text)
        return text
