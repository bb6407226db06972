"""The layout's import rules (docs/DESIGN.md §2.1), checked on lit_dllm's import graph, read from the source.

Every import of a lit_dllm module counts, at module level or inside a function (``TYPE_CHECKING`` blocks excepted:
they never run). A module's room is the first name below ``lit_dllm`` (``lit_dllm.hub.hf`` is in ``hub``;
``lit_dllm`` itself, the package's ``__init__``, is ``__init__``). The floors, lowest first:

0. leaves that import no other room: ``compat`` (every private name of another library), ``settings`` (the typed
   settings groups), ``throughput`` (FLOP counts), ``testing`` (the tiny model shapes);
1. ``hub``: Hugging Face and GGUF loading, block discovery; ``noise``: the forward process (keyed draws and their
   streams, the corruption kernels and their Triton launches), which the families, ``core`` and ``rl`` call and
   ``data`` does not; ``upgrade``: every conversion from an earlier layout (one file, removed in 0.3);
2. primitives: ``data`` (collation, packing, tokenizer, the data module), ``losses``, ``attention`` (what every
   family's masks are built with), ``reference`` (the reference's full-logits losses);
3. what ``configure_model`` applies and the checkpoint plumbing: ``parallel``, ``meshes``, ``experts``,
   ``context_parallel``, ``fp8``, ``lora``, ``strategies``, ``checkpointing``;
4. ``core``: the family-neutral LightningModule bases, generation, optimiser, backbone; ``rl``: the RL step shared by
   the families' RL modules, its objectives, rewards and settings group (over ``core``);
5. ``families``: one folder each, importing ``core`` and below and never another family;
6. the top: ``eval``, ``callbacks``, ``cli`` and ``__init__`` (the public API).

A module imports only its own floor or lower ones, and no import circle exists, at any floor. An import inside a
function must point down and be listed in :data:`LAZY_IMPORTS` with its reason (a function-level import that hides
a circle means a function is in the wrong room); function-level imports of optional third-party packages are free.
"""

import ast
from pathlib import Path

import lit_dllm

PACKAGE = Path(lit_dllm.__file__).parent
FAMILIES = sorted(path.name for path in (PACKAGE / "families").iterdir() if (path / "__init__.py").is_file())

FLOORS = {
    "compat": 0, "settings": 0, "throughput": 0, "testing": 0,
    "hub": 1, "noise": 1, "upgrade": 1,
    "data": 2, "losses": 2, "attention": 2, "reference": 2,
    "parallel": 3, "meshes": 3, "experts": 3, "context_parallel": 3, "fp8": 3, "lora": 3, "converters": 3,
    "strategies": 3, "checkpointing": 3,
    "core": 4, "rl": 4,
    "families": 5,
    "eval": 6, "callbacks": 6, "cli": 6, "__init__": 6,
}
LAZY_IMPORTS = {
    ("lit_dllm.noise.corruption", "lit_dllm.noise.fused_corruption"):
        "the Triton kernels' module imports triton, which a CPU-only install may lack (then the eager path runs)",
}
"""The function-level imports of lit_dllm modules allowed, (importer, imported) -> why it is not at the top."""


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, modules: set[str]) -> list[tuple[str, bool]]:
    """The modules among ``modules`` that ``path`` (the module ``name``) imports, each with whether the import runs
    inside a function."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot after the first
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from lit_dllm import compat` imports the module lit_dllm.compat
                found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return [(module, lazy) for module, lazy in found if module in modules]


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, bool]]:
    """Each lit_dllm module -> the lit_dllm modules it imports -> whether every such import is inside a function."""
    paths = {module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, dict[str, bool]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, {})
        for target, lazy in imports(path, name, set(paths)):
            if target != name:
                edges[target] = edges.get(target, True) and lazy
    return graph


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "families" else None


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The import circles of ``graph``: one list of modules per strongly connected component of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def violations(graph: dict[str, dict[str, bool]], floors: dict[str, int] = FLOORS,
               lazy_allowed: dict[tuple[str, str], str] = LAZY_IMPORTS) -> list[str]:
    """Every broken rule of ``graph``, one line each."""
    found = [f"import circle: {' <-> '.join(component)}" for component in cycles(graph)]
    for module, edges in sorted(graph.items()):
        if room(module) not in floors:
            found.append(f"{module}: its room {room(module)!r} has no floor; add it to FLOORS and docs/DESIGN.md §2.1")
            continue
        for target, lazy in sorted(edges.items()):
            floor, target_floor = floors[room(module)], floors.get(room(target), 0)
            if target_floor > floor:
                found.append(f"{module} imports {target}: upward (floor {floor} -> {target_floor})")
            if family(module) and family(target) and family(module) != family(target):
                found.append(f"{module} imports {target}: another family")
            if lazy and (target_floor > floor or (module, target) not in lazy_allowed):
                found.append(f"{module} imports {target} inside a function: move it to the top, or list it in "
                             "LAZY_IMPORTS with the reason")
    return found


def test_the_package_keeps_the_layering():
    assert violations(import_graph()) == []


def test_the_checker_reports_a_circle_an_upward_import_a_family_and_a_hidden_import():
    graph = {
        "lit_dllm.losses": {"lit_dllm.reference.losses": True},  # hidden in a function, and part of a circle
        "lit_dllm.reference.losses": {"lit_dllm.losses": False},
        "lit_dllm.hub.hf": {"lit_dllm.core.token_loss": False},  # upward
        "lit_dllm.core.token_loss": {},
        "lit_dllm.families.dflash.model": {"lit_dllm.families.mdlm.model": False},
        "lit_dllm.families.mdlm.model": {},
    }
    assert violations(graph) == [
        "import circle: lit_dllm.losses <-> lit_dllm.reference.losses",
        "lit_dllm.families.dflash.model imports lit_dllm.families.mdlm.model: another family",
        "lit_dllm.hub.hf imports lit_dllm.core.token_loss: upward (floor 1 -> 4)",
        "lit_dllm.losses imports lit_dllm.reference.losses inside a function: move it to the top, or list it in "
        "LAZY_IMPORTS with the reason",
    ]


def test_the_graph_reads_every_kind_of_import(tmp_path):
    package = tmp_path / "lit_dllm"
    (package / "data").mkdir(parents=True)
    for name in ("__init__.py", "compat.py", "data/__init__.py", "data/keys.py"):
        (package / name).write_text("")
    (package / "data" / "collate.py").write_text(
        "from typing import TYPE_CHECKING\nfrom lit_dllm import compat\nfrom . import keys\n"
        "if TYPE_CHECKING:\n    import lit_dllm.cli\n"
        "def f():\n    from lit_dllm.data.keys import x\n    import lit_dllm\n"
    )
    assert import_graph(package)["lit_dllm.data.collate"] == {
        "lit_dllm.compat": False, "lit_dllm.data.keys": False, "lit_dllm": True}


def test_the_shipped_families_each_have_a_module_and_a_model():
    assert FAMILIES == ["causal_lm", "dflash", "diffusion_gemma", "mdlm"]
    for name in FAMILIES:
        assert (PACKAGE / "families" / name / "module.py").is_file()
        assert (PACKAGE / "families" / name / "model.py").is_file()


def test_bench_imports_nothing_from_tests():
    """Benchmarks take their tiny shapes from :mod:`lit_dllm.testing`, not from the tests."""
    for path in (PACKAGE.parent / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(name == "tests" or name.startswith("tests.") for name in names), path.name
