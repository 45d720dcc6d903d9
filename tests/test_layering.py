"""Import layering of ``ttrace_num``, checked on the source (ast, nothing executed).

* ``ttrace_num.bounds`` (the error models) imports neither ``ttrace_num.propagate``,
  ``ttrace_num.calibrate`` nor ``ttrace_num.cli``;
* ``ttrace_num.calibrate`` does not import ``ttrace_num.cli``;
* no module of ``ttrace_num`` imports ``tracer``.

Every import statement counts, including those inside functions (a lazy import is still a
dependency) and ``TYPE_CHECKING`` blocks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ttrace_num"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module the source of module ``name`` imports (``from X import y``
    gives ``X`` and ``X.y``); relative imports are resolved against ``name``'s package."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                mod = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _modules(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py")) if sub else sorted(PACKAGE.rglob("*.py"))


def _violations_of(source: str, name: str, forbidden: tuple[str, ...], is_package: bool = False) -> list[str]:
    return [f"{name} imports {mod}" for mod in sorted(imported_modules(source, name, is_package))
            if any(mod == f or mod.startswith(f + ".") for f in forbidden)]


def _violations(sub: str, forbidden: tuple[str, ...]) -> list[str]:
    return [v for path in _modules(sub)
            for v in _violations_of(path.read_text(), _module_name(path), forbidden, path.name == "__init__.py")]


RULES = [
    ("bounds", ("ttrace_num.propagate", "ttrace_num.calibrate", "ttrace_num.cli")),
    ("calibrate", ("ttrace_num.cli",)),
    ("", ("tracer",)),
]


@pytest.mark.parametrize("sub,forbidden", RULES, ids=[f"{s or 'ttrace_num'}-not-{'|'.join(f)}" for s, f in RULES])
def test_layering(sub, forbidden):
    assert _modules(sub), f"no module found under ttrace_num/{sub}"
    assert _violations(sub, forbidden) == []


def test_the_parser_sees_every_kind_of_import():
    """The check itself: relative (from a module and from a package), absolute and
    in-function imports are all resolved."""
    src = "from ..propagate import jacobian\nimport tracer.capture\ndef f():\n    from ..cli import main\n"
    mods = imported_modules(src, "ttrace_num.bounds.x")
    assert {"ttrace_num.propagate", "ttrace_num.propagate.jacobian", "tracer.capture", "ttrace_num.cli"} <= mods
    assert "ttrace_num.cli" in imported_modules("from ..cli import main\n", "ttrace_num.calibrate", is_package=True)
    assert _violations_of(src, "ttrace_num.bounds.x", RULES[0][1]) == [
        "ttrace_num.bounds.x imports ttrace_num.cli", "ttrace_num.bounds.x imports ttrace_num.cli.main",
        "ttrace_num.bounds.x imports ttrace_num.propagate", "ttrace_num.bounds.x imports ttrace_num.propagate.jacobian"]
