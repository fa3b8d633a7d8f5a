"""The OpenAI-compatible HTTP API of the engine (FastAPI)."""
from agentkv.engine.api.app import create_app

__all__ = ["create_app"]
