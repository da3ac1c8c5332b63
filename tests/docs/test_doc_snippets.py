"""The python code blocks of README.md and docs/jax_flax.md run, each on its own (a fresh namespace, the
8 CPU devices of the tests): a reader can paste any one of them."""
import contextlib
import io
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/jax_flax.md"]


def _blocks(name: str) -> list[tuple[str, int, str]]:
    text = (ROOT / name).read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, m.start()) + 2
        out.append((name, line, m.group(1)))
    return out


BLOCKS = [b for name in DOCS for b in _blocks(name)]


def test_the_docs_have_code_to_run():
    assert {name for name, _, _ in BLOCKS} == set(DOCS) and len(BLOCKS) >= 8


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[f"{n}:{line}" for n, line, _ in BLOCKS])
def test_block_runs_on_its_own(name, line, code):
    saved = dict(os.environ)
    try:
        # (blank lines keep the traceback's line numbers those of the document)
        program = compile("\n" * (line - 1) + code, str(ROOT / name), "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(program, {"__name__": f"snippet_{line}"})
    finally:
        os.environ.clear()
        os.environ.update(saved)
