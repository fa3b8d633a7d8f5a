"""Streamed reply text: what is shown as tokens arrive adds up to the
non-streamed content, never shows a stop string or a tool call's markup, and
never has to be taken back."""
import pytest

from agentkv.engine.api.replies import ReplyText
from agentkv.engine.stops import cut_at_stop
from agentkv.engine.turn import TurnResult, parse_reply
from agentkv.experiments.default_model.tokenizer import build_default_tokenizer
from agentkv.model.tokenizer import Tokenizer
from agentkv.model.tool_calls import TOOL_CALL_FORMATS

EOS = [2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_default_tokenizer(path)
    return Tokenizer.from_dir(path)


def turn_result(tokenizer, ids: list[int], stops, fmt) -> TurnResult:
    """The finished turn's reply, as engine.turn parses it (the finish reason
    as the scheduler gives it: a stop string or EOS ends it, else the budget)."""
    content, calls = parse_reply(tokenizer, ids, list(stops), fmt)
    stopped = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), tuple(stops))[1] or ids[-1] in EOS
    return TurnResult(content, calls, {}, "tool_calls" if calls else "stop" if stopped else "length", ids)


def stream(tokenizer, text: str, stops=(), tool_format=None, step: int = 1):
    """(the deltas, the reply) of `text` pushed `step` tokens at a time."""
    ids = tokenizer.encode(text)
    fmt = TOOL_CALL_FORMATS[tool_format] if tool_format else None
    reply = ReplyText(tokenizer, tuple(stops), fmt)
    deltas = [reply.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    rest, whole = reply.finish(turn_result(tokenizer, ids, stops, fmt))
    return deltas + [rest], whole


CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize(
    "text,stops,tool_format,content,finish",
    [
        ("Zürich café — naïve → done", (), None, "Zürich café — naïve → done", "length"),
        ("read the file and stop here please", ("stop here",), None, "read the file and ", "stop"),
        ("a <tool box> is not a call", (), "hermes", "a <tool box> is not a call", "length"),
        ("Let me look.  \n" + CALL + "\nThen I report.", (), "hermes", "Let me look.\nThen I report.", "tool_calls"),
        (CALL, (), "hermes", None, "tool_calls"),
        (CALL, (), None, CALL, "length"),  # tools not offered: the markup is text
        ('{"name": "read_file", "parameters": {"path": "a"}}', (), "llama3_json", None, "tool_calls"),
        ('{"name": "Ada"} is JSON for the user', (), "llama3_json", '{"name": "Ada"} is JSON for the user', "length"),
    ],
)
def test_streamed_text_adds_up_to_the_reply(tokenizer, text, stops, tool_format, content, finish, step):
    deltas, reply = stream(tokenizer, text, stops, tool_format, step)
    assert reply.content == content and reply.finish_reason == finish
    assert "".join(deltas) == (content or "")
    for delta in deltas:
        assert "<tool_call>" not in delta or tool_format is None
        assert not any(s in delta for s in stops)


def test_tool_calls_become_openai_calls(tokenizer):
    _, reply = stream(tokenizer, CALL + "\n" + CALL.replace("a.py", "b.py"), tool_format="hermes")
    assert [c.function.name for c in reply.tool_calls] == ["read_file", "read_file"]
    assert [c.function.arguments for c in reply.tool_calls] == ['{"path": "src/a.py"}', '{"path": "src/b.py"}']
    assert all(c.id.startswith("call_") and c.type == "function" for c in reply.tool_calls)


def test_a_reply_ending_in_eos_is_stopped(tokenizer):
    ids = tokenizer.encode("done") + EOS
    text = ReplyText(tokenizer, (), None)
    shown = text.push(ids)
    rest, reply = text.finish(turn_result(tokenizer, ids, (), None))
    assert shown + rest == "done" and reply.finish_reason == "stop"
