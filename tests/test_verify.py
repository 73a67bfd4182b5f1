"""`models.verify.Verifier` on real files: only recorded files are read, verdicts are cached by
file identity, a changed identity is read again, and a cancel stops hashing at once."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from jupyter_lmsp.models.digests import ModelFileError, file_digests, model_files
from jupyter_lmsp.models.verify import Cancelled, Mismatch, Verifier


@pytest.fixture
def model(tmp_path: Path, test_model_dir: Path) -> tuple[Path, list[dict]]:
    copy = tmp_path / "model"
    shutil.copytree(test_model_dir, copy)
    return copy, file_digests(copy)


def test_verdicts_are_cached_by_identity(model):
    path, files = model
    verifier = Verifier()
    verifier.check(path, files)
    first = verifier.bytes_hashed
    assert first == sum(f["size"] for f in files)
    verifier.check(path, files)
    assert verifier.bytes_hashed == first  # nothing read again
    weights = path / "model.safetensors"
    os.utime(weights)  # same bytes, new identity: read again
    verifier.check(path, files)
    assert verifier.bytes_hashed == first + weights.stat().st_size


def test_changed_extra_and_irregular_files_are_refused_without_reading(model, tmp_path):
    path, files = model
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate(100 * 1024**3)
    verifier = Verifier()
    (path / "model-00002.safetensors").symlink_to(huge)
    with pytest.raises(Mismatch, match="not registered") as e:
        verifier.check(path, files)
    assert e.value.paths == ["model-00002.safetensors"]
    (path / "model-00002.safetensors").unlink()
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(huge)
    with pytest.raises(Mismatch, match="registered"):
        verifier.check(path, files)
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    with pytest.raises(Mismatch, match="not a regular file"):
        verifier.check(path, files)
    assert verifier.bytes_hashed == 0


def test_a_flipped_byte_is_found(model):
    path, files = model
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(Mismatch) as e:
        Verifier().check(path, files)
    assert e.value.paths == ["model.safetensors"]


def test_a_cancel_stops_hashing(model):
    path, files = model
    big = path / "padding.bin"
    with open(big, "wb") as f:
        f.truncate(4 * 1024**3)
    files = [*files, {"path": "padding.bin", "size": big.stat().st_size, "sha256": "0" * 64}]
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        Verifier().check(path, files, cancel)
    assert time.monotonic() - started < 2


def test_model_files_refuse_what_a_model_may_not_hold(model, tmp_path):
    path, _ = model
    (tmp_path / "secret").write_text("x")
    (path / "notes.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(ModelFileError, match="leading out") as e:
        model_files(path)
    assert e.value.code == "unsafe_model_file"
    (path / "notes.txt").unlink()
    (path / "alias.safetensors").symlink_to(path / "model.safetensors")  # inside: fine
    assert any(p.name == "alias.safetensors" for p, _ in model_files(path))
    (path / "sub").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ModelFileError, match="linked folder"):
        model_files(path)
    (path / "sub").unlink()
    os.mkfifo(path / "pipe")
    with pytest.raises(ModelFileError, match="not a regular file"):
        model_files(path)
    (path / "pipe").unlink()
    with pytest.raises(ModelFileError) as e:
        model_files(path, max_bytes=1000)
    assert e.value.code == "model_too_large"
