"""The import flow of the package (docs/design.md): language -> compiler -> kernels -> api ->
tools / integrations.

Every module of the package is parsed (not imported) and each of its imports, module-level or
inside a function, must come from its own layer or a lower one. Triton is imported only under
``kernels/triton/`` (and lazily, inside a function, in ``tools/bench.py``), and importing
the package never loads Triton (modules of ``kernels/triton/`` that need no Triton, such as
configurations, may be imported anywhere above the kernels). Outside ``kernels/triton/`` a
module imports at module level only the standard library and the core dependencies of
pyproject.toml: optional ones (matplotlib, transformers, ...) are imported inside functions.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = "compilemask"
SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / PKG
PYPROJECT = SRC.parent / "pyproject.toml"

# Layer of each top-level package or module of compilemask; a module may import from its own
# layer or lower ones. masks / workloads build language IR, so they sit with the language;
# score_mods (modifier objects, read by kernels and api) sits there too.
LAYERS = {
    "errors": 0,
    "language": 1,
    "masks": 1,
    "workloads": 1,
    "score_mods": 1,  # score modifiers: descriptions and their torch twins (errors, torch)
    "compiler": 2,
    "kernels": 3,
    "api": 4,
    "testing": 4,  # error bounds for kernel tests (uses kernels.reference and the api)
    "distributed": 5,  # context parallelism over torch.distributed (runs the api per rank)
    "tools": 5,
    "integrations": 5,  # adapters to other libraries (transformers), imported lazily
    "__init__": 5,  # the package itself re-exports everything
    "__main__": 5,
}
TRITON_HOME = ("kernels", "triton")
LAZY_TRITON_ALLOWED = {("tools", "bench.py")}
#: the CuTe-DSL kernel module: the only one importing cutlass at module level (the backend
#: imports it inside its launch function)
#: the cute modules that import cutlass at module level (kernels/cute/backend.py imports them
#: on first use only)
CUTE_KERNEL = (("kernels", "cute", "forward_sm90.py"), ("kernels", "cute", "launch.py"))


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


def _layer_of(dotted: list[str]) -> int:
    """Layer of an absolute module path inside compilemask (['compilemask', 'compiler', ...])."""
    if len(dotted) == 1:
        return LAYERS["__init__"]
    head = dotted[1]
    if head not in LAYERS:
        raise AssertionError(f"module {'.'.join(dotted)} is in no layer: add it to LAYERS")
    return LAYERS[head]


def _imports(path: Path):
    """Yield (absolute target as a list, lineno, is_lazy) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me[:-1]
    lazy_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split("."), node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = node.module.split(".")
            if target == [PKG] or (node.module is None and target[:1] == [PKG]):
                # `from .. import masks`: each imported name may be a submodule
                for alias in node.names:
                    sub = target + [alias.name]
                    is_module = (
                        SRC.joinpath(*sub).with_suffix(".py").exists()
                        or SRC.joinpath(*sub).is_dir()
                    )
                    yield (sub if is_module else target), node.lineno, lazy
            else:
                yield target, node.lineno, lazy


MODULES = _modules()


def test_package_has_modules():
    assert any(p.name == "workloads.py" for p in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_downwards(path: Path):
    me = _module_name(path)
    my_layer = _layer_of(me) if path.name != "__main__.py" else LAYERS["__main__"]
    bad = []
    for target, line, _lazy in _imports(path):
        if target[0] != PKG:
            continue
        if _layer_of(target) > my_layer:
            bad.append(f"line {line}: imports {'.'.join(target)} (layer {_layer_of(target)})")
    assert not bad, f"{'.'.join(me)} (layer {my_layer}) imports upwards:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_triton_only_under_kernels_triton(path: Path):
    rel = path.relative_to(ROOT).parts
    in_home = rel[: len(TRITON_HOME)] == TRITON_HOME
    bad = [
        f"line {line}: imports {'.'.join(target)}"
        for target, line, lazy in _imports(path)
        if target[0] == "triton" and not in_home and not (rel in LAZY_TRITON_ALLOWED and lazy)
    ]
    assert not bad, f"{path.relative_to(ROOT)} imports Triton outside kernels/triton:\n" + (
        "\n".join(bad)
    )


@pytest.mark.parametrize(
    "module",
    ["compilemask.language", "compilemask.masks", "compilemask.workloads", "compilemask.tools.cli"],
)
def test_importing_does_not_load_triton(module: str):
    code = f"import sys, {module}; sys.exit(2 if 'triton' in sys.modules else 0)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=SRC, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 2, f"importing {module} loads triton"
    assert done.returncode == 0, done.stderr


def test_importing_the_package_does_not_load_triton():
    if not (ROOT / "__init__.py").exists():
        pytest.skip("compilemask/__init__.py does not exist yet")
    code = (
        "import sys, compilemask; "
        "sys.exit(2 if {'triton', 'cutlass', 'flash_attn', 'cudnn'} & set(sys.modules) else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=SRC, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 2, "import compilemask loads triton, cutlass, flash_attn or cudnn"
    assert done.returncode == 0, done.stderr


BACKEND_FOLDERS = ("reference", "triton", "cudnn", "fa4", "cute")


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.relative_to(ROOT).parts[0] == "api"], ids=lambda p: p.name
)
def test_api_imports_no_backend(path: Path):
    """api/ reaches backends through kernels/registry.py and kernels/interface.py only: no
    import from kernels/<backend>/ (backend-specific code lives in its folder)."""
    bad = [
        f"line {line}: imports {'.'.join(target)}"
        for target, line, _lazy in _imports(path)
        if target[:2] == [PKG, "kernels"] and len(target) > 2 and target[2] in BACKEND_FOLDERS
    ]
    assert not bad, f"api/{path.name} imports a backend:\n" + "\n".join(bad)


def _core_dependencies() -> set[str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}


def test_core_dependencies_leave_out_the_extras():
    core = _core_dependencies()
    assert {"torch", "numpy"} <= core
    assert not core & {"matplotlib", "triton", "transformers"}, "an extra became a core dependency"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_level_imports_are_core_dependencies(path: Path):
    allowed = {PKG, "__future__", *_core_dependencies()}
    if path.relative_to(ROOT).parts[: len(TRITON_HOME)] == TRITON_HOME:
        allowed.add("triton")  # the package imports kernels/triton lazily
    if path.relative_to(ROOT).parts in CUTE_KERNEL:
        allowed.update({"cutlass", "cuda"})  # imported by kernels/cute/backend.py lazily
    bad = [
        f"line {line}: imports {target[0]} at module level"
        for target, line, lazy in _imports(path)
        if not lazy and target[0] not in allowed and target[0] not in sys.stdlib_module_names
    ]
    assert not bad, f"{path.relative_to(ROOT)} needs an optional dependency:\n" + "\n".join(bad)
