"""The layout's import rules (docs/DESIGN.md §2.1): ``core`` imports no family, no family imports another, each
family folder has its module and model, and bench/ imports nothing from tests/."""

import ast
from pathlib import Path

import lit_dllm

PACKAGE = Path(lit_dllm.__file__).parent
FAMILIES = sorted(path.name for path in (PACKAGE / "families").iterdir() if (path / "__init__.py").is_file())


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Each ``.py`` file below ``folder`` -> the ``lit_dllm`` modules it imports (at any depth of its code)."""
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
        found[str(path.relative_to(PACKAGE))] = {name for name in names if name.startswith("lit_dllm")}
    return found


def test_the_shipped_families_each_have_a_module_and_a_model():
    assert FAMILIES == ["causal_lm", "dflash", "diffusion_gemma", "mdlm"]
    for family in FAMILIES:
        assert (PACKAGE / "families" / family / "module.py").is_file()
        assert (PACKAGE / "families" / family / "model.py").is_file()


def test_core_imports_no_family():
    offending = {file: names for file, names in imported_modules(PACKAGE / "core").items()
                 if any(name.startswith("lit_dllm.families") for name in names)}
    assert not offending


def test_no_family_imports_another():
    for family in FAMILIES:
        others = tuple(f"lit_dllm.families.{other}" for other in FAMILIES if other != family)
        offending = {file: names for file, names in imported_modules(PACKAGE / "families" / family).items()
                     if any(name.startswith(others) for name in names)}
        assert not offending, family


def test_bench_imports_nothing_from_tests():
    """Benchmarks take their tiny shapes from :mod:`lit_dllm.testing`, not from the tests."""
    for path in (PACKAGE.parent / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(name == "tests" or name.startswith("tests.") for name in names), path.name
