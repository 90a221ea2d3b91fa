"""The import rules that keep the layout honest, read from the source (every import statement,
including those inside functions):

- the engine imports no front: no grpc, no HTTP stack, nothing from service.fronts, the client or the server;
- the runtime imports neither the engine nor a front (the engine builds on it, never the reverse);
- serving (service/) imports neither torch, transformers nor gguf, nor anything from model/, export/ or bench/;
- export/ and model/ use from service/ only the runtime (the bundle format, the tokenizer, the runners);
- the network (the modules at the top of model/) imports neither training (model/training/) nor Hugging Face
  or GGUF conversion (model/hf/, model/gguf/), and export/ builds on the network alone;
- no two modules of service/, model/ or export/ import each other, directly or through others: an import
  inside a function or under TYPE_CHECKING counts too, as it hides a cycle from the interpreter, not from
  whoever reads the two modules;
- no test outside tests/bench imports bench/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every package of model/: the network at the top, and the subpackages that build on it
MODEL_PACKAGES = ("model", "model/training", "model/hf", "model/gguf")
# the folders no import cycle may run through
CYCLE_FREE = ("service", "model", "export")

FRONT_MODULES = ("grpc", "grpc_health", "grpc_reflection", "attnserve.v1", "fastapi", "starlette", "uvicorn",
                 "http", "service.fronts", "service.client", "service.server", "service.settings")


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def sources(*folders: str, root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py"))


def offences(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name} imports {module}"
            for path in files for module in sorted(imports(path)) if under(module, *forbidden)]


def test_the_rules_see_imports_inside_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n\ndef f():\n    from model.gpt import GPT\n    import torch.nn\n")
    assert imports(probe) == {"os", "model.gpt", "torch.nn"}
    assert offences([probe], ("torch", "model")) == ["probe.py imports model.gpt", "probe.py imports torch.nn"]
    assert under("torch.nn", "torch") and not under("torchvision", "torch")


@pytest.mark.parametrize("folders,forbidden", [
    (("service/engine",), FRONT_MODULES),
    (("service/runtime",), FRONT_MODULES + ("service.engine",)),
    (("service",), ("torch", "transformers", "gguf", "model", "export", "bench")),
    (("export", "model"), ("service.engine", "service.fronts", "service.client", "service.server", "service.settings")),
], ids=["engine-imports-no-front", "runtime-imports-no-engine-or-front", "serving-imports-no-torch-or-model", "export-and-model-use-only-the-runtime"])
def test_import_rule(folders, forbidden):
    assert offences(sources(*folders), forbidden) == []


def test_the_rules_know_every_package_of_model():
    """A new subpackage of model/ is a choice of what may import it: add it to MODEL_PACKAGES and to the rules."""
    assert sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / "model").rglob("__init__.py")) == sorted(MODEL_PACKAGES)


def test_the_network_imports_neither_training_nor_hugging_face_conversion():
    network = sorted((ROOT / "model").glob("*.py"))
    assert network and offences(network, ("model.training", "model.hf", "model.gguf")) == []


def test_export_builds_on_the_network_alone():
    assert offences(sources("export"), ("model.training", "model.hf", "model.gguf")) == []


def module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_graph(*folders: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of `folders` -> the modules of `folders` it imports, by any import statement in it."""
    files = {module_name(p, root): p for p in sources(*folders, root=root)}
    graph = {}
    for name, path in files.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from model.training import g2p_data` imports the module model.training.g2p_data
                graph[name].update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                                   for a in node.names if node.module in files or f"{node.module}.{a.name}" in files)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others, each group sorted."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return seen

    reach = {name: reachable(name) for name in graph}
    groups = {tuple(sorted(other for other in reach[name] if name in reach[other]))
              for name in graph if name in reach[name]}
    return [list(group) for group in sorted(groups)]


def test_the_cycle_rule_sees_imports_in_functions_and_under_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (package / "d.py").write_text("import pkg.c\nimport pkg.a\n")
    graph = import_graph("pkg", root=tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_import_cycle_in_service_model_or_export():
    assert cycles(import_graph(*CYCLE_FREE)) == []


def test_no_test_outside_tests_bench_imports_bench():
    tests = [p for p in sources("tests") if "bench" not in p.relative_to(ROOT / "tests").parts[:1]]
    assert offences(tests, ("bench",)) == []
