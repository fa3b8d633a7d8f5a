"""Function-calling accuracy on BFCL v4 (the Berkeley Function Calling
Leaderboard's data, PyPI bfcl-eval): a model behind an OpenAI-compatible
server, in BFCL's function-calling (FC) mode.

Categories: simple_python, multiple, parallel (single-turn: one request, its
tool calls checked against BFCL's possible answers), irrelevance (passes when
the model makes no call) and multi_turn_base (a live agent loop per
conversation on BFCL's own executable classes, scored by BFCL's multi-turn
checker). Every request is what BFCL's OpenAI FC handler sends: the entry's
own messages, no system prompt, its function docs (as bfcl's loader gives
them) as OpenAI tools, greedy; no BFCL item is ever used for anything else.

Checks:
- single-turn: BFCL's AST checker (eval_checker/ast_eval/ast_checker.py),
  ported here for Python: bfcl's module imports its model registry, which
  needs every provider's SDK. Function name; required parameters present;
  no parameter outside the doc and the answer; each value's type (an int
  passes for a float) and value among the allowed ones, strings compared
  after BFCL's normalization (case, spaces and ",./-_*^" ignored); optional
  parameters left out only where the answer allows ""; parallel calls
  matched in any order.
- multi_turn_base: bfcl's own multi_turn_checker, which replays the
  model's calls and the ground truth's on fresh instances, turn by turn:
  the instances' public attributes must match (state), and the ground
  truth's results must be among the model's results so far (responses).

    python -m agentkv.experiments.benchmarks.eval_bfcl --model models/agent-8m [--limit 20]
    python -m agentkv.experiments.benchmarks.eval_bfcl --base-url http://127.0.0.1:8000/v1 \\
        [--categories simple_python,multiple,parallel,irrelevance,multi_turn_base] [--limit N] [--seed 0] \\
        [--max-tokens 512] [--max-steps 8] [--concurrency 4] [--out runs/eval_bfcl/NAME.json]

Needs bfcl-eval installed without its dependencies (they pin an old numpy):
pip install --no-deps bfcl-eval.
"""
from __future__ import annotations

import argparse
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from agentkv.experiments.drivers.servers import start_engine_server
from agentkv.experiments.report import table, write_json
from agentkv.experiments.workloads.bfcl import (Chat, Item, Reply, decode_calls, load_items, openai_tools, record,
                                                run_multi_turn, tool_name)

CATEGORIES = ("simple_python", "multiple", "parallel", "irrelevance", "multi_turn_base")
# The AST checker's types for Python docs ("any" is checked as a string).
PYTHON_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
                "dict": dict, "any": str}


class ServerChat:
    """Chat completions on an OpenAI-compatible server, greedy."""

    def __init__(self, base_url: str, model: str, max_tokens: int, api_key: str, timeout: float):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
        self.model, self.max_tokens = model, max_tokens

    def __call__(self, messages: list[dict], tools: list[dict]) -> Reply:
        # BFCL sends tools only when the entry has some.
        extra = {"tools": tools} if tools else {}
        response = self.client.chat.completions.create(
            model=self.model, messages=messages, temperature=0, max_tokens=self.max_tokens, **extra)
        msg = response.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or ()]
        return Reply(msg.content, calls)


# ---------------------------------------------------------------------------
# BFCL's AST checker (Python)


def check_ast(functions: list[dict], calls: list[dict], answers: list[dict], category: str) -> str | None:
    """BFCL's ast_checker for a Python category: None when calls ([{name:
    args}]) match the possible answers ([{name: {param: allowed values}}]),
    else the reason (BFCL's error type first)."""
    if "parallel" in category:
        return _parallel_error(functions, calls, answers)
    if "multiple" in category:
        if len(calls) != len(answers):
            return f"multiple_function_checker:wrong_count: {len(calls)} calls, expected {len(answers)}"
        return check_call(_find_doc(functions, next(iter(answers[0]))), calls[0], answers[0])
    if len(calls) != 1:
        return f"simple_function_checker:wrong_count: {len(calls)} calls, expected 1"
    return check_call(functions[0], calls[0], answers[0])


def _find_doc(functions: list[dict], name: str) -> dict:
    return next(doc for doc in functions if doc["name"] == name)


def _parallel_error(functions: list[dict], calls: list[dict], answers: list[dict]) -> str | None:
    """Order-free: each answer, in turn, takes the first call left that matches it."""
    if len(calls) != len(answers):
        return f"parallel_function_checker_no_order:wrong_count: {len(calls)} calls, expected {len(answers)}"
    left = list(range(len(calls)))
    for answer in answers:
        doc = _find_doc(functions, next(iter(answer)))
        hit = next((i for i in left if check_call(doc, calls[i], answer) is None), None)
        if hit is None:
            return f"parallel_function_checker_no_order:cannot_find_match: no call matches {answer}"
        left.remove(hit)
    return None


def check_call(doc: dict, call: dict, answer: dict) -> str | None:
    """BFCL's simple_function_checker: None when call ({name: args}) matches
    answer ({name: {param: allowed values}}, "" among them: may be left out)."""
    allowed = next(iter(answer.values()))
    name = tool_name(doc["name"])
    if name not in call:
        return f"simple_function_checker:wrong_func_name: {name!r} not called ({next(iter(call))!r})"
    args, params = call[name], doc["parameters"]
    for param in params.get("required", []):
        if param not in args:
            return f"simple_function_checker:missing_required: {param!r}"
    for param, value in args.items():
        if param not in params["properties"] or param not in allowed:
            return f"simple_function_checker:unexpected_param: {param!r}"
        if (why := _value_error(param, value, params["properties"][param], allowed[param])) is not None:
            return why
    for param, values in allowed.items():
        if param not in args and "" not in values:
            return f"simple_function_checker:missing_optional: {param!r} not given"
    return None


def _value_error(param: str, value: Any, prop: dict, allowed: list) -> str | None:
    kind = prop["type"]
    expected = PYTHON_TYPES[kind]
    nested = PYTHON_TYPES[prop["items"]["type"]] if kind in ("array", "tuple") else None
    if kind == "float" and type(value) is int:  # Python converts an int where a float is expected
        value = float(value)
    type_ok, is_variable = _type_check(value, allowed, expected, nested)
    if not type_ok:
        return f"type_error: {param!r} expected {kind}, got {type(value).__name__} {value!r}"
    if not is_variable:
        if expected is dict:
            return _dict_error(param, value, allowed)
        if expected is list and nested is dict:
            return _list_dict_error(param, value, allowed)
        if expected is str:
            ok = standardize(value) in [standardize(a) for a in allowed if type(a) is str]
            return None if ok else f"value_error:string: {param!r} = {value!r}, expected one of {allowed}"
        if expected is list:
            ok = _standardize_items(value) in [_standardize_items(a) for a in allowed]
            return None if ok else f"value_error:list/tuple: {param!r} = {value!r}, expected one of {allowed}"
    return None if value in allowed else f"value_error:others: {param!r} = {value!r}, expected one of {allowed}"


def _type_check(value: Any, allowed: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """BFCL's type_checker: (type ok, is_variable). An allowed value of
    another type than the doc's stands for a variable name: a value of that
    type passes, then is compared as is. A list is checked one level deep
    against each allowed list."""
    answer_type = next((type(a) for a in allowed if a != ""), None)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected and (nested is None or any(
            type(a) is not list or all(_type_check(v, a, nested, None)[0] for v in value) for a in allowed)):
        return True, is_variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, is_variable


def standardize(text: str) -> str:
    """BFCL's string normalization: no spaces or ",./-_*^", lower case, ' as "."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _standardize_items(values: Any) -> list:
    return [standardize(v) if type(v) is str else v for v in values]


def _dict_error(param: str, value: dict, allowed: list) -> str | None:
    why = "dict_checker:unclear"
    for option in allowed:
        if option == "":
            continue
        why = _dict_mismatch(value, option)
        if why is None:
            return None
    return f"{why} (in {param!r})"


def _dict_mismatch(value: dict, option: dict) -> str | None:
    for key, v in value.items():
        if key not in option:
            return f"value_error:dict_key: unexpected key {key!r}"
        if (standardize(v) if type(v) is str else v) not in _standardize_items(option[key]):
            return f"value_error:dict_value: {key!r} = {v!r}, expected one of {option[key]}"
    missing = [key for key, values in option.items() if key not in value and "" not in values]
    return f"value_error:dict_key: missing key {missing[0]!r}" if missing else None


def _list_dict_error(param: str, value: list, allowed: list) -> str | None:
    why = "list_dict_checker:unclear"
    for option in allowed:
        if len(value) != len(option):
            why = f"value_error:list_dict_count: {len(value)} dicts, expected {len(option)}"
            continue
        why = next((e for v, o in zip(value, option) if (e := _dict_error(param, v, [o])) is not None), None)
        if why is None:
            return None
    return why


# ---------------------------------------------------------------------------
# Running items


def run_single_turn(chat: Chat, entry: dict, answers: list[dict] | None, category: str) -> dict:
    """One request; its calls checked (irrelevance: passes without a call)."""
    reply = chat(entry["question"][0], openai_tools(entry["function"]))
    try:
        calls = decode_calls(reply)
    except ValueError as e:
        if category == "irrelevance":
            return record(True, None, [])
        return record(False, f"ast_decoder:decoder_failed: {e}", [])
    if category == "irrelevance":
        return record(not calls, "irrelevance_error:decoder_success: called a function" if calls else None, calls)
    why = check_ast(entry["function"], calls, answers, category)
    return record(why is None, why, calls)


# ---------------------------------------------------------------------------
# The run


def run_item(chat: Chat, item: Item, max_steps: int) -> dict:
    """The item's record; a failed request fails the item."""
    start = time.perf_counter()
    try:
        if item.category.startswith("multi_turn"):
            made = run_multi_turn(chat, item.entry, item.answer, max_steps)
        else:
            made = run_single_turn(chat, item.entry, item.answer, item.category)
    except openai.APIError as e:
        made = record(False, f"request_error: {type(e).__name__}: {e}", [])
    return {"id": item.entry["id"], "category": item.category, **made,
            "seconds": round(time.perf_counter() - start, 3)}


def evaluate(chat: Chat, items: list[Item], concurrency: int, max_steps: int, desc: str = "") -> list[dict]:
    """Every item's record, in the items' order, concurrency at a time."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(tqdm(pool.map(partial(run_item, chat, max_steps=max_steps), items), total=len(items), desc=desc))


def summarize(records: list[dict], seconds: dict[str, float]) -> dict[str, dict]:
    """Per category: items, the fraction passed, wall seconds."""
    out = {}
    for category, wall in seconds.items():
        passed = [r["passed"] for r in records if r["category"] == category]
        out[category] = {"n": len(passed), "accuracy": sum(passed) / max(len(passed), 1), "wall_s": wall}
    return out


def served_model(base_url: str, api_key: str) -> str:
    """The server's (first) model name, from GET /v1/models."""
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).models.list().data[0].id


def run(args: argparse.Namespace, base_url: str) -> dict:
    model = args.model_name or served_model(base_url, args.api_key)
    chat = ServerChat(base_url, model, args.max_tokens, args.api_key, args.timeout)
    records, seconds = [], {}
    for category in args.categories:
        items = load_items(category, args.limit, args.seed)
        start = time.perf_counter()
        records += evaluate(chat, items, args.concurrency, args.max_steps, desc=category)
        seconds[category] = time.perf_counter() - start
    return {"model": model, "base_url": base_url, "args": dict(vars(args)), "summary": summarize(records, seconds),
            "records": records}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="an OpenAI-compatible server's /v1")
    p.add_argument("--model", default=None,
                   help="start serve.py on this checkpoint directory (on a free port) instead of using --base-url")
    p.add_argument("--serve-args", default="", help="more serve.py flags with --model, e.g. \"--dtype auto\"")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the started server")
    p.add_argument("--model-name", default=None, help="the requests' model (default: the server's first)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma list of " + ", ".join(CATEGORIES))
    p.add_argument("--limit", type=int, default=None, help="items per category: a seeded subset (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=512, help="cap on each reply")
    p.add_argument("--max-steps", type=int, default=8,
                   help="multi-turn: replies with calls per user turn before the conversation is cut off "
                        "(BFCL's own limit: 20)")
    p.add_argument("--concurrency", type=int, default=4, help="items in flight at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="the JSON written (default runs/eval_bfcl/<model name>.json)")
    args = p.parse_args(argv)
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    if unknown := [c for c in args.categories if c not in CATEGORIES]:
        p.error(f"unknown categories {unknown}; choose from {', '.join(CATEGORIES)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.model:
        with start_engine_server(args.model, threads=args.threads, extra_args=shlex.split(args.serve_args)) as server:
            print(f"server ready in {server.startup_s:.1f} s (log: {server.log})")
            results = run(args, server.base_url)
    else:
        results = run(args, args.base_url)
    results["wall_s"] = time.perf_counter() - start
    out = Path(args.out or Path("runs") / "eval_bfcl" / f"{results['model'].replace('/', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results)
    rows = [[c, s["n"], 100 * s["accuracy"], s["wall_s"]] for c, s in results["summary"].items()]
    print(f"BFCL v4, {results['model']}:")
    print(table(["category", "n", "accuracy %", "wall s"], rows))
    print(f"wall {results['wall_s']:.1f} s; wrote {out}")
    return results


if __name__ == "__main__":
    main()
