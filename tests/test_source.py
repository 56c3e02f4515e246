"""``low_bits_training.source``: the one digest of the package's source and stack that the suite's compiled-kernel
cache folder (tests/conftest.py) and the kept peak plans (titan/launch/peak_cache.py) are keyed by."""

import subprocess
import sys

from low_bits_training import source


def test_the_digest_follows_every_py_file_and_the_stack(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not source")
    monkeypatch.setattr(source, "PACKAGE", tmp_path)
    first = source.source_digest()
    assert source.source_digest() == first and len(first) == 64
    (tmp_path / "notes.txt").write_text("changed, and not a .py file")
    assert source.source_digest() == first
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("")
    second = source.source_digest()
    assert second != first  # a new (even empty) module
    (tmp_path / "a.py").write_text("x = 2\n")
    third = source.source_digest()
    assert third not in (first, second)
    monkeypatch.setattr(source, "installed_version", lambda dist: "9.9" if dist == "torchao" else "1.0")
    assert source.source_digest() != third  # another torchao


def test_reading_it_imports_no_torch():
    # conftest reads it before the inductor cache folder is set, which must happen before torch._dynamo loads
    code = (
        "import sys; import low_bits_training.source as s; s.source_digest(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
