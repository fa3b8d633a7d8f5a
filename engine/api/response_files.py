"""Stored Responses on disk (serve.py --state-dir), so that a
previous_response_id made before a restart still continues after it.

One record per stored response under <state>/responses
(engine.api.json_files): the response, its tenant and KV namespace, its input items, the
whole conversation up to its reply (so a record stands alone: an expired
predecessor takes nothing with it), the session's tokens, tier key and
message log (so that a continuation after a restart is still native; a
record without one, as earlier servers wrote them, continues by prefix). Written once the session's KV was
written through to the disk tier.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agentkv.engine import MessageLog
from agentkv.engine.api.json_files import JsonFiles
from agentkv.engine.api.session_files import check_key, check_tokens

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")


@dataclass(frozen=True)
class SavedResponse:
    response: dict
    tenant: str
    namespace: str
    input_items: list[dict]
    conversation: list[dict]
    key: str
    tokens: list[int]
    order: int  # least recently used first on reload
    log: MessageLog | None = None  # which chat messages the tokens are (engine.message_log)


def _name(response_id: str) -> str:
    if not RESPONSE_ID.match(response_id):
        raise ValueError(f"not a response id: {response_id!r}")
    return response_id


class ResponseFiles:
    def __init__(self, root: str | Path):
        self.files = JsonFiles(root, "response")

    @property
    def reports(self) -> list[str]:
        return self.files.reports

    def save(self, s: SavedResponse) -> None:
        self.files.write(_name(s.response["id"]), {
            "response": s.response, "tenant": s.tenant, "namespace": s.namespace, "input_items": s.input_items,
            "conversation": s.conversation, "key": s.key, "tokens": s.tokens, "order": s.order,
            "log": s.log.to_json() if s.log is not None else None})

    def delete(self, response_id: str) -> None:
        self.files.delete(_name(response_id))

    def load(self, vocab_size: int) -> list[SavedResponse]:
        return sorted(self.files.read_all(lambda b: _parse(b, vocab_size)), key=lambda s: s.order)

    def load_one(self, response_id: str, vocab_size: int) -> SavedResponse | None:
        """One saved response (a replica sharing the folder may have saved it); None if there is none."""
        if not RESPONSE_ID.match(response_id):
            return None
        found = self.files.read(response_id, lambda b: _parse(b, vocab_size))
        return found[0] if found is not None and found[0].response["id"] == response_id else None

    def saved(self, response_id: str) -> bool:
        return self.files.stamp(_name(response_id)) is not None


def _parse(b: dict, vocab_size: int) -> SavedResponse:
    _name(b["response"]["id"])
    log = MessageLog.from_json(b["log"]) if b.get("log") is not None else None
    return SavedResponse(b["response"], str(b["tenant"]), str(b["namespace"]), list(b["input_items"]), list(b["conversation"]),
                         check_key(b["key"]), check_tokens(b["tokens"], vocab_size), int(b["order"]), log)
