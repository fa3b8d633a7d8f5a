"""The embedded default tokenizer: a byte-level BPE the project trains itself.

Nothing is downloaded: a seeded generator writes a small corpus of the text
an agent engine sees (English messages, file paths, ids, JSON arguments, tool
schemas, log lines, code), and `tokenizers` trains on it. Same code, same
`tokenizers` version, same files.

A build step, not a runtime one: train.py writes tokenizer.json and
tokenizer_config.json (the chat template in it) into the checkpoint, and the
engine loads those files (model/tokenizer.py), never this module.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from agentkv.model.tokenizer import render_chat_template

__all__ = ["build_default_tokenizer", "generate_corpus", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "TOOL_TOKENS"]

# Control tokens: skipped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Atomic like the control tokens but not special, as in Qwen2.5: a decoded reply keeps its
# <tool_call> markers so that the tool call parser still finds them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MODEL_MAX_LENGTH = 32768
_CONTROL_TOKENS = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))
CORPUS_SEED = 0
CORPUS_BYTES = 1_500_000

# ChatML with tools in the Hermes / Qwen2.5 convention. Prefix-stable for a
# stateful engine: what a message renders to depends only on the messages up to
# it, so the prompt of one turn plus the reply is the start of the next turn's
# prompt. The one look-ahead, as in Qwen2.5, is that a run of tool results
# shares one user turn, closed by whatever message follows the run.
CHAT_TEMPLATE = r"""{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- "<|im_start|>system\n" + system_message }}
{%- if tools %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" + tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
{%- endif %}
{{- "<|im_end|>\n" }}
{%- for message in messages %}
    {%- if loop.first and message.role == "system" %}
        {#- written above, with the tools #}
    {%- elif message.role in ("user", "system") %}
        {{- "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" }}
    {%- elif message.role == "assistant" %}
        {{- "<|im_start|>assistant\n" }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- if message.content or not loop.first %}
                {{- "\n" }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {#- OpenAI clients send arguments as a JSON string: it is already the JSON to write. #}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- "}\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}
            {{- "<|im_start|>user" }}
        {%- endif %}
        {{- "\n<tool_response>\n" }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- message.content | tojson }}
        {%- endif %}
        {{- "\n</tool_response>" }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- "<|im_end|>\n" }}
        {%- endif %}
    {%- else %}
        {{- raise_exception("unknown message role: " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}"""

_WORDS = """the a an to of and in is it that for on with as this be are was by not or from at we you
they he she will can should must may then when if but so all any each some more most other new
first last next only just also now here there what which who how why where because after before
into over under about between without again still already please thanks ok yes no""".split()
_NOUNS = """file function test module request response error user agent task plan result value cache
session token page buffer config server client model output input record query index table schema
field step worker planner reviewer report branch commit patch build deploy container job queue event
message tool call argument list directory path line column version issue ticket customer order invoice
price weather city temperature forecast database row key timeout retry limit budget summary draft""".split()
_VERBS = """read write update check run fix add remove create parse load save send fetch return compute
verify merge split open close list find search call retry review plan summarize schedule deploy build
install configure restart delete rename copy move compare validate format print log raise handle""".split()
_ADJECTIVES = """new old empty invalid missing current previous next large small slow fast remote local
failed pending final partial stale cached public private internal external default optional""".split()
_DIRECTORIES = """src lib tests docs engine model cache utils api core scripts config data logs tmp build app
services handlers components migrations fixtures examples""".split()
_NAME_PARTS = _VERBS + _NOUNS
_EXTENSIONS = "py json md txt yaml toml log js ts rs go sh csv html sql".split()
_TOOL_NAMES = """read_file write_file list_directory search_code run_command run_tests get_weather http_get
query_database send_email create_ticket git_diff git_commit web_search calculator""".split()
_ARGUMENT_KEYS = """path query limit offset content pattern command timeout city url id name recursive
max_results branch message unit days sql to subject body title priority""".split()
# Agents pass names, units and scripts beyond ASCII; a few keep their UTF-8 bytes merged.
_NON_ASCII = "Zürich café naïve São_Paulo Kraków °C — … → ✓ • 東京 数据 файл ошибка ünïcödé".split()
_LEVELS = ("DEBUG", "INFO", "INFO", "WARNING", "ERROR")
_ROLES = ("planner", "researcher", "coder", "reviewer", "executor")
_T = TypeVar("_T")


class _CorpusWriter:
    """One seeded source of every kind of text; each method returns a document."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choice(self, items: Sequence[_T]) -> _T:
        return self.rng.choice(items)

    def hex(self, n: int) -> str:
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(n))

    def identifier(self) -> str:
        return "_".join(self.choice(_NAME_PARTS) for _ in range(self.rng.randint(1, 3)))

    def path(self) -> str:
        parts = [self.choice(_DIRECTORIES) for _ in range(self.rng.randint(1, 4))]
        root = self.choice(("", "", "/", "./", "/home/agent/"))
        return root + "/".join(parts) + f"/{self.identifier()}.{self.choice(_EXTENSIONS)}"

    def number(self) -> str:
        return self.choice((str(self.rng.randint(0, 9)), str(self.rng.randint(10, 999)),
                            str(self.rng.randint(1000, 10**6)), f"{self.rng.uniform(0, 100):.2f}"))

    def timestamp(self) -> str:
        r = self.rng
        return f"2024-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z"

    def uuid(self) -> str:
        return f"{self.hex(8)}-{self.hex(4)}-{self.hex(4)}-{self.hex(4)}-{self.hex(12)}"

    def sentence(self) -> str:
        words = []
        for _ in range(self.rng.randint(5, 16)):
            kind = self.rng.random()
            if kind < 0.45:
                words.append(self.choice(_WORDS))
            elif kind < 0.65:
                words.append(self.choice(_NOUNS) + self.choice(("", "", "s")))
            elif kind < 0.8:
                words.append(self.choice(_VERBS) + self.choice(("", "", "s", "ed", "ing")))
            elif kind < 0.9:
                words.append(self.choice(_ADJECTIVES))
            elif kind < 0.93:
                words.append(f"`{self.path()}`")
            elif kind < 0.96:
                words.append(self.choice(_NON_ASCII))
            else:
                words.append(self.number())
        text = " ".join(words)
        return text[0].upper() + text[1:] + self.choice((".", ".", ".", "?", "!", ":"))

    def prose(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(1, 5)))

    def json_value(self, depth: int = 0) -> object:
        kind = self.rng.random()
        if kind < 0.3:
            return self.path()
        if kind < 0.45:
            return self.rng.randint(0, 5000)
        if kind < 0.55:
            return self.rng.random() < 0.5
        if kind < 0.7:
            return self.sentence()
        if kind < 0.8:
            return self.uuid()
        if kind < 0.9 and depth < 2:
            return [self.json_value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        if depth < 2:
            return self.json_object(depth + 1)
        return self.identifier()

    def json_object(self, depth: int = 0) -> dict:
        return {self.choice(_ARGUMENT_KEYS): self.json_value(depth) for _ in range(self.rng.randint(1, 4))}

    def dumps(self, obj: object) -> str:
        return json.dumps(obj, ensure_ascii=False, indent=self.choice((None, None, 2, 4)))

    def call_object(self) -> dict:
        return {"name": self.choice(_TOOL_NAMES), "arguments": self.json_object()}

    def schema_object(self) -> dict:
        keys = sorted({self.choice(_ARGUMENT_KEYS) for _ in range(self.rng.randint(1, 4))})
        properties = {k: {"type": self.choice(("string", "integer", "boolean", "array")),
                          "description": self.sentence()} for k in keys}
        return {"type": "function", "function": {
            "name": self.choice(_TOOL_NAMES), "description": self.prose(),
            "parameters": {"type": "object", "properties": properties, "required": keys[:1]}}}

    def result_object(self) -> dict:
        return {"status": self.choice(("ok", "ok", "error")), "id": f"call_{self.hex(24)}",
                "output": self.json_object(), "elapsed_ms": self.rng.randint(1, 9000)}

    def json_document(self) -> str:
        return self.dumps(self.choice((self.call_object, self.call_object, self.schema_object, self.result_object))())

    def conversation(self) -> str:
        """A tool-calling conversation in the default chat format, control tokens blanked:
        the trainer does not split on added tokens, so they would only add noise."""
        messages = [{"role": "system", "content": self.prose()}] if self.rng.random() < 0.7 else []
        messages.append({"role": "user", "content": self.prose()})
        for _ in range(self.rng.randint(1, 3)):
            calls = [self.call_object() for _ in range(self.rng.randint(1, 2))]
            messages.append({"role": "assistant", "content": self.choice(("", "", self.sentence())),
                             "tool_calls": [{"type": "function", "function": call} for call in calls]})
            messages += [{"role": "tool", "content": self.dumps(self.result_object())} for _ in calls]
        messages.append({"role": "assistant", "content": self.prose()})
        tools = [self.schema_object() for _ in range(self.rng.randint(0, 2))] or None
        text = render_chat_template(CHAT_TEMPLATE, messages, tools, add_generation_prompt=False)
        return _CONTROL_TOKENS.sub("\n", text)

    def log_lines(self) -> str:
        return "\n".join(
            f"{self.timestamp()} {self.choice(_LEVELS)} [{self.choice(_DIRECTORIES)}.{self.identifier()}] "
            f"{self.sentence()} request_id={self.hex(16)} took={self.number()}ms"
            for _ in range(self.rng.randint(1, 8)))

    def code(self) -> str:
        name, arg = self.identifier(), self.choice(_ARGUMENT_KEYS)
        body = self.choice((
            f"    with open({arg}) as f:\n        return json.load(f)",
            f"    if not {arg}:\n        raise ValueError(\"{self.sentence()}\")\n    return {arg}",
            f"    result = []\n    for item in {arg}:\n        result.append(item.{self.identifier()}())\n    return result",
            f"    return {{\"{arg}\": {arg}, \"count\": len({arg})}}",
        ))
        return f"def {name}({arg}: str) -> dict:\n    \"\"\"{self.sentence()}\"\"\"\n{body}\n"

    def shell(self) -> str:
        return self.choice((
            f"$ git diff --stat {self.hex(7)}..HEAD", f"$ pytest -q {self.path()}", f"$ cat {self.path()}",
            f"$ grep -rn \"{self.identifier()}\" {self.choice(_DIRECTORIES)}/", f"$ ls -la {self.path()}",
        )) + "\n" + self.log_lines()

    def agent_message(self) -> str:
        role = self.choice(_ROLES)
        return f"[{role} -> {self.choice(_ROLES)}] {self.prose()} I will call {self.choice(_TOOL_NAMES)} on {self.path()}."

    def markdown(self) -> str:
        items = "\n".join(f"{i + 1}. {self.sentence()}" for i in range(self.rng.randint(2, 5)))
        return f"## {self.sentence()}\n\n{self.prose()}\n\n{items}"


def generate_corpus(seed: int = CORPUS_SEED, total_bytes: int = CORPUS_BYTES) -> Iterator[str]:
    """Deterministic training documents, about `total_bytes` of UTF-8 in all."""
    writer = _CorpusWriter(seed)
    kinds: list[tuple[Callable[[], str], int]] = [
        (writer.prose, 4), (writer.agent_message, 3), (writer.json_document, 5), (writer.conversation, 2),
        (writer.log_lines, 2), (writer.code, 2), (writer.shell, 1), (writer.markdown, 1),
    ]
    makers = [maker for maker, _ in kinds]
    weights = [weight for _, weight in kinds]
    written = 0
    while written < total_bytes:
        document = writer.rng.choices(makers, weights)[0]()
        written += len(document.encode("utf-8"))
        yield document


def build_default_tokenizer(out_dir: str | Path, vocab_size: int = 4096) -> Path:
    """Train the default tokenizer and write tokenizer.json and tokenizer_config.json
    into `out_dir` (created if needed). Returns `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: a message renders the same at the start of a turn as anywhere else.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # The tool tokens are added after training, so they count against the vocabulary here.
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer)
    # The trainer forces special=True on its tokens; these must stay visible in decoded text.
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        # transformers would otherwise strip spaces before punctuation when decoding.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir
