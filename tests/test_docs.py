"""The Python examples in README.md and docs/ run as written.

An example is a fenced ``python`` block that imports ``low_bits_training`` (blocks about other tools, and the
field listing of ``QuantSpec``, are not). A ``print(...)`` whose comment starts with a spec label
(``# e4m3/block32(e8m0,rceil)/rne``) must print exactly that label: the docs' numbers are the code's.
"""

import re

import pytest

from helpers import REPO

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
LABEL = re.compile(r"#\s*(\S+/\S+?)(?::|\s|$)")


def examples() -> list[tuple[str, int, str]]:
    """(file, line of the fence, code) of every example block."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if "import low_bits_training" in m.group(1) or "from low_bits_training" in m.group(1):
                out.append((str(path.relative_to(REPO)), text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def test_the_docs_have_python_examples_for_each_public_package():
    code = "\n".join(c for _, _, c in examples())
    for package in ("formats", "nn", "optim"):
        assert f"from low_bits_training.{package} import" in code, package


@pytest.mark.parametrize(("path", "line", "code"), examples(), ids=lambda v: str(v)[:40])
def test_example_runs_and_prints_what_it_says(path, line, code, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "__doc_example__"})
    printed = capsys.readouterr().out.splitlines()
    claims = [LABEL.search(ln) for ln in code.splitlines() if ln.startswith("print(")]
    assert len(printed) == len(claims), f"{path}:{line}: one line per print"
    for out, claim in zip(printed, claims, strict=True):
        if claim is not None:
            assert out == claim.group(1), (
                f"{path}:{line}: prints {out!r}, the comment says {claim.group(1)!r}"
            )
