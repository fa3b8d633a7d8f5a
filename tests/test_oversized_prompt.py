"""A chat too long for the context is refused before the engine's lock and
before its grammar: a client's megabyte of tool schema costs it the refusal,
not every other request's step (issue 56's hostile tenant)."""
import re
from concurrent.futures import ThreadPoolExecutor, TimeoutError

import pytest

from agentkv import ContextLengthError, Engine
from agentkv.engine.turn import OVERSIZED_CHARS_PER_TOKEN
from agentkv.model.default import SMALL_MODEL_DIR, random_init


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)
    random_init(eng.model, 0)
    return eng


def huge_enum_tool(engine) -> list[dict]:
    n = OVERSIZED_CHARS_PER_TOKEN * engine.max_context // 8
    values = [f"region-{i:07d}" for i in range(n)]
    return [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "required": ["region"], "properties": {"region": {"type": "string", "enum": values}}}}}]


def test_a_schema_past_the_context_is_refused_while_the_engine_is_busy(engine):
    tools = huge_enum_tool(engine)
    compiles = engine.grammars.compiles
    messages = [{"role": "user", "content": "Which region is on fire?"}]
    with ThreadPoolExecutor(1) as pool, engine.lock:  # a step under way holds the lock
        refused = pool.submit(engine.chat, messages, tools=tools, tool_choice="required", max_tokens=4)
        try:
            with pytest.raises(ContextLengthError, match="leave no room"):
                refused.result(timeout=30)
        except TimeoutError:
            pytest.fail("the refusal waited for the engine's lock")
    assert engine.grammars.compiles == compiles  # no grammar compiled for a refused prompt


@pytest.mark.slow
def test_a_long_text_that_fits_is_served(engine):
    # More characters than the check's threshold, far fewer tokens than the
    # context (the vocabulary's longest word, repeated): the check counts, never guesses.
    tok = engine.tokenizer
    word = max((w for w in map(tok.decode, ([i] for i in range(tok.backend.get_vocab_size())))
                if re.fullmatch(r" [a-z]+", w)), key=len)
    content = word * (OVERSIZED_CHARS_PER_TOKEN * engine.max_context // len(word) + 1)
    prompt_len = len(engine.tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    assert prompt_len < engine.max_context
    r = engine.chat([{"role": "user", "content": content}], max_tokens=2)
    assert r.usage["prompt_tokens"] == prompt_len
