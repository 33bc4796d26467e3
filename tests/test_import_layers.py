"""Dependencies flow one way: kernels (with megaq.config.flags), parallel, runtime, model,
zero, parallelize, data, config, checkpoint, planner, training, CLI, testing. Every import in every
module under megaq/ and kernels/ (including the ones inside functions) may only point at its
own layer or one below it, and no modules import each other in a circle, not even inside one
layer.

The walk reads the source (ast), so nothing is imported and an import hidden in a
function body counts like one at the top.
"""

import ast
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS = [
    ("kernels", ("kernels", "megaq.kernels", "megaq.config.flags", "megaq")),
    ("parallel", ("megaq.parallel",)),
    # failure agreement (a collective over the parallel layer's groups), the roll call, the
    # hang watchdog, the metrics file and log lines: what a running job reports
    ("runtime", ("megaq.runtime",)),
    ("model", ("megaq.model",)),
    ("zero", ("megaq.zero",)),
    # applies the parallel layer's pieces and the zero engine to the model, in one order
    ("parallelize", ("megaq.parallelize",)),
    ("data", ("megaq.data",)),
    # the configuration package (megaq.config.flags, which imports nothing of megaq, sits
    # in the bottom layer so every layer's config class can declare its flags): RunConfig,
    # Megatron-LM's flag table, the parser; what an HF export holds (the --save-hf check
    # and the converters recognise one by it)
    ("config", ("megaq.config", "megaq.export_files")),
    # the package: formats, manifest, directory guards, staging; the one allow-listed
    # unpickler every checkpoint reader (and the converters) use
    ("checkpoint", ("megaq.checkpoint",)),
    # the step-time and memory model: reads the model, layout, ZeRO and run configuration;
    # training writes its prediction, the CLI prints it
    ("planner", ("megaq.planner",)),
    ("training", ("megaq.training", "megaq.lr_schedule")),
    # megaq.config.arguments assembles the whole program's parser, the planner's hardware
    # flags and --dry-run included, so it sits with the CLI, above the planner
    ("cli", ("megaq.config.arguments", "megaq.pretrain", "pretrain_gpt", "megaq.cli",
             "megaq.plan_cli",
             # the converters (they validate an imported architecture with the parser and
             # write a megaq checkpoint)
             "megaq.interop")),
    # local gloo ranks for tests and tools (run_on_ranks, run_cli_on_ranks): the top, so
    # no library module can lean on a test seam
    ("testing", ("megaq.testing",)),
]


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def modules():
    for top in ("megaq", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    yield rel[:-len(".__init__")] if rel.endswith(".__init__") else rel, path


def imports_of(module: str, path: str, is_package: bool):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:  # `from megaq import checkpoint` names a module; a name
                yield f"{base}.{a.name}", node.lineno  # in a module has that module's layer


def upward_imports():
    bad = []
    for module, path in modules():
        mine = layer_of(module)
        assert mine is not None, f"{module} belongs to no layer: add it to LAYERS"
        for target, line in imports_of(module, path, path.endswith("__init__.py")):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{os.path.relpath(path, REPO)}:{line}: {module} "
                           f"({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    return bad


def test_no_upward_import():
    bad = upward_imports()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


# ------------------------------------------------------------------------ circles
def import_graph() -> dict[str, set[str]]:
    """{module: the modules it imports (function-local imports included)}, over the
    modules under megaq/ and kernels/. `from megaq import checkpoint` and `from
    megaq.checkpoint.paths import iteration_dir` each point at the module they name
    (the longest prefix that is one), not at the packages around it."""
    mods = dict(modules())
    graph = {}
    for module, path in mods.items():
        edges = set()
        for target, _ in imports_of(module, path, path.endswith("__init__.py")):
            parts = target.split(".")
            for k in range(len(parts), 0, -1):
                name = ".".join(parts[:k])
                if name in mods:
                    if name not in (module, "megaq"):  # the root package holds no code
                        edges.add(name)
                    break
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted:
    every module of one imports every other, through some chain."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# Circles known today and owned elsewhere, each with what removes it. The test fails on
# any other circle, and on a listed one that is gone (delete its entry then).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not new, "modules importing each other in a circle:\n" + "\n".join(map(str, new))
    assert not gone, f"listed circles no longer there: delete them from KNOWN_CYCLES: {gone}"


def test_the_walk_sees_a_circle_through_function_local_imports(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other, one only inside a function,
    are one circle; a one-way import is none."""
    pkg = tmp_path / "megaq" / "data"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from megaq.data import b\n")
    (pkg / "b.py").write_text("def f():\n    from megaq.data.a import g\n")
    (pkg / "c.py").write_text("import megaq.data.a\n")
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    assert import_cycles(import_graph()) == [["megaq.data.a", "megaq.data.b"]]


def test_nothing_imports_the_entry_script():
    """pretrain_gpt.py is a script; its code lives in megaq.pretrain."""
    offenders = []
    for top in ("megaq", "kernels", "tools", "tests"):
        for dirpath, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                             else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    if "pretrain_gpt" in names:
                        offenders.append(os.path.relpath(path, REPO))
    assert not offenders


@pytest.mark.parametrize("source,expect", [
    ("from megaq.training import Trainer", "imports megaq.training.Trainer (training)"),
    ("from megaq import checkpoint", "imports megaq.checkpoint (checkpoint)"),
    ("def f():\n    import megaq.model.gpt", "imports megaq.model.gpt (model)"),
])
def test_the_walk_sees_an_upward_import(tmp_path, monkeypatch, source, expect):
    """The checker itself: a parallel-layer module importing upward is reported."""
    pkg = tmp_path / "megaq" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text(source + "\n")
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    bad = upward_imports()
    assert len(bad) == 1 and expect in bad[0] and "megaq.parallel.bad (parallel)" in bad[0]
