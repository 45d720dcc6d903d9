"""The Python examples in README.md and docs/*.md run as written (from the repo root)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "propagation.md", ROOT / "docs" / "tracing-storage.md", ROOT / "docs" / "tracing-hooks.md"]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path, monkeypatch):
    blocks = _blocks(path)
    assert blocks, f"{path.name} has no python example"
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {}
    for code in blocks:  # blocks of one file share a namespace, as in a reader's session
        exec(compile(code, str(path), "exec"), namespace)
