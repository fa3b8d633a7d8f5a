"""The OpenAI-compatible HTTP API of the engine (FastAPI)."""
from engine.api.app import create_app

__all__ = ["create_app"]
