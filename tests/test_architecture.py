"""The package's shape, checked on its source: no import cycles, layers kept apart, classes that hold their own
methods, private names kept in their module."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hydra_trio"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _import_statements(name: str, tree: ast.AST | None = None) -> list[tuple[int, str, list[str]]]:
    """Each import of module ``name`` (top level, inside functions, under TYPE_CHECKING) as
    ``(line, module, names)``: ``from M import a, b`` is ``M`` (made absolute) with ``[a, b]``,
    ``import M`` is ``M`` with ``[]``; ``tree``: the module's source (default: read from its file)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
    return out


def _imports(name: str) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: top level, inside functions, under TYPE_CHECKING."""
    found: set[str] = set()
    for _line, mod, names in _import_statements(name):
        targets = [f"{mod}.{n}" if f"{mod}.{n}" in MODULES else mod for n in names] or [mod]
        for t in targets:
            while t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != name:
                found.add(t)
    return found


def test_the_scan_sees_the_package() -> None:
    assert "hydra_trio.engine.engine" in MODULES and "hydra_trio.hydra.ops" in MODULES
    assert "hydra_trio.engine.batching.scheduler" in _imports("hydra_trio.engine.engine")


def test_no_import_cycles() -> None:
    graph = {m: _imports(m) for m in MODULES}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


TREES = _trees()
PACKAGE_CLASSES = {node.name for tree in TREES.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _is_private(name: str) -> bool:
    """``_x``: private; ``__x__`` (a protocol) and ``_x_`` (ctypes' ``_fields_``...) are not."""
    return name.startswith("_") and not name.endswith("_")


def _annotation_class(annotation: ast.expr | None) -> str | None:
    """The class an annotation names (``Engine``, ``"Engine"``, ``mod.Engine``), else None."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Attribute):
        return annotation.attr
    return None


def _methods_outside_their_class(tree: ast.Module) -> list[str]:
    """Module-level functions that are a class's methods in all but place: the first parameter is named
    ``self`` (or ``cls``), or it is annotated with a class of the package and the function assigns one of
    its attributes or uses one of its private members (it changes the object's state or reads its inside:
    what a method does).  A function that only reads an object's public face (``service`` functions
    over an ``Engine``, ``kv_identity(m: LoadedModel)``) is that object's client, not its method."""
    found = []
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = fn.args.posonlyargs + fn.args.args
        if not params:
            continue
        first = params[0]
        if first.arg in ("self", "cls"):
            found.append(f"{fn.lineno}: {fn.name}({first.arg})")
            continue
        if _annotation_class(first.annotation) not in PACKAGE_CLASSES:
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == first.arg
                and (isinstance(node.ctx, (ast.Store, ast.Del)) or _is_private(node.attr))
            ):
                found.append(
                    f"{fn.lineno}: {fn.name}({first.arg}) {'sets' if isinstance(node.ctx, ast.Store) else 'uses'}"
                    f" .{node.attr}"
                )
                break
    return found


def test_no_function_is_a_method_moved_out_of_its_class() -> None:
    """A class holds what its objects do: no module-level function takes an object of the package as its
    ``self`` (:func:`_methods_outside_their_class`), so a class's size is its responsibility's, never a
    method parked beside it."""
    assert _methods_outside_their_class(ast.parse("def reconfigure(self: Engine, n: int): pass")) == [
        "1: reconfigure(self)"
    ]
    assert _methods_outside_their_class(ast.parse("def sample(sched: 'Scheduler'): sched._on_token(1)")) == [
        "1: sample(sched) uses ._on_token"
    ]
    assert _methods_outside_their_class(ast.parse("def f(e: Engine): e.config = 1")) == ["1: f(e) sets .config"]
    assert _methods_outside_their_class(ast.parse("def f(e: Engine): return e.config.n_ctx")) == []
    found = {name: lines for name, tree in TREES.items() if (lines := _methods_outside_their_class(tree))}
    assert found == {}, found


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and module names, its classes' methods
    and class attributes, and attributes set on ``self``/``cls``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
    return {n for n in out if _is_private(n)}


OWN_PRIVATE = {name: _own_private_names(tree) for name, tree in TREES.items()}
PACKAGE_PRIVATE = set().union(*OWN_PRIVATE.values())

FOREIGN_PRIVATES = {
    # trio's SSLStream: the bulk TLS path hands over the bytes it buffered and marks the stream broken
    ("hydra_trio.transport.tls_bulk", "_plain"),
    ("hydra_trio.transport.tls_bulk", "_early"),
    ("hydra_trio.transport.tls_bulk", "_state"),
    ("hydra_trio.transport.tls_bulk", "_delayed_outgoing"),
    ("hydra_trio.transport.blocking", "_delayed_outgoing"),
    # the flag parser's own mark on argparse's Namespace (which flags a config file supplied)
    ("hydra_trio.cli._flags", "_accepted_given"),
}
"""Private members of other libraries that the package uses, which the scan cannot tell from its own."""


def _private_uses(name: str, tree: ast.Module) -> list[str]:
    """Where module ``name`` uses another module's private member: ``from m import _x`` (``m`` a module of
    the package), an import from a private module outside the importer's own package (``from ..http._hyper
    import ...``), ``obj._x`` for a private name the package defines elsewhere but this module does not, and
    ``obj._x = ...`` on anything but ``self``/``cls`` for a private name this module does not define."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    other_libraries = {
        (a.asname or a.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if not a.name.startswith("hydra_trio")
    }  # os._exit is os's
    for line, mod, names in _import_statements(name, tree):
        if not mod.startswith("hydra_trio"):
            continue
        parts = mod.split(".")
        for i, part in enumerate(parts):
            if _is_private(part) and not f"{package}.".startswith(".".join(parts[:i]) + "."):
                found.append(f"{line}: {mod}")
        found += [f"{line}: {mod}.{n}" for n in names if _is_private(n) and f"{mod}.{n}" not in MODULES]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or (name, node.attr) in FOREIGN_PRIVATES:
            continue
        receiver = node.value
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls", *other_libraries):
            continue
        if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
            continue
        if node.attr not in OWN_PRIVATE[name] and (isinstance(node.ctx, ast.Store) or node.attr in PACKAGE_PRIVATE):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_no_private_member_is_used_from_another_module() -> None:
    """A ``_name`` is its module's (or its class's) own: no other module imports it, reads it or sets it
    (:func:`_private_uses`); what two modules share is public."""
    tree = ast.parse(
        "from hydra_trio.engine.engine import _x, Engine\nfrom ..http._hyper import H\n"
        "import os\ndef f(s):\n    s._hand_off.emit()\n    s._kv = 1\n    self._y = 2\n    os._exit(0)"
    )
    assert _private_uses("hydra_trio.node.server", tree) == [
        "1: hydra_trio.engine.engine._x",
        "2: hydra_trio.http._hyper",
        "5: s._hand_off",
        "6: s._kv",
    ]
    found = {name: lines for name, tree in TREES.items() if (lines := _private_uses(name, tree))}
    assert found == {}, found


SIDE_FOLDERS = ("bench", "fuzz", "examples")
"""The folders beside the package: the benches, the fuzzer and the examples (each module a script or a helper)."""


def _side_private_uses(folder: str, tree: ast.Module, side_private: set[str]) -> list[str]:
    """Where a module of ``folder`` (one of :data:`SIDE_FOLDERS`) uses another module's private member:
    ``from m import _x`` (anything but a module of ``folder`` itself, such as ``bench/_table.py``), an
    import from a private module of another folder or of the package (``hydra_trio.http._hyper``), and
    ``obj._x`` for a private name that the package or a side module defines but this module does not."""
    own = _own_private_names(tree)
    siblings = {p.stem for p in (PKG.parent / folder).glob("*.py")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            inside = node.level > 0 or mod.split(".")[0] == folder
            if not inside and any(_is_private(part) for part in mod.split(".")):
                found.append(f"{node.lineno}: {mod}")
            found += [
                f"{node.lineno}: {mod}.{a.name}"
                for a in node.names
                if _is_private(a.name) and not (inside and mod in ("", folder) and a.name in siblings)
            ]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in PACKAGE_PRIVATE or node.attr in side_private:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_benches_and_the_fuzzer_use_no_private_name_of_another_module() -> None:
    """The rule of :func:`test_no_private_member_is_used_from_another_module` for ``bench/``, ``fuzz/`` and
    ``examples/``: what a bench takes from another bench, or from the package, is public."""
    tree = ast.parse(
        "from bench.kv_transfer import _put_bytes, prefill\nfrom bench._table import Row\nfrom bench import _decode\n"
        "from hydra_trio.http._hyper import H\nfrom hydra_trio.models.presets import _smollm2\n"
        "def f(e):\n    e._hand_off.emit()\n    self._mine = 1"
    )
    assert _side_private_uses("bench", tree, {"_put_bytes"}) == [
        "1: bench.kv_transfer._put_bytes",
        "4: hydra_trio.http._hyper",
        "5: hydra_trio.models.presets._smollm2",
        "7: e._hand_off",
    ]
    trees = {
        p: ast.parse(p.read_text()) for folder in SIDE_FOLDERS for p in sorted((PKG.parent / folder).rglob("*.py"))
    }
    side_private = set().union(*(_own_private_names(tree) for tree in trees.values()))
    found = {
        str(p.relative_to(PKG.parent)): lines
        for p, tree in trees.items()
        if (lines := _side_private_uses(p.relative_to(PKG.parent).parts[0], tree, side_private))
    }
    assert found == {}, found


TOP_LEVEL = {
    "hydra_trio",
    "hydra_trio.__main__",
    "hydra_trio._version",
    "hydra_trio._lazy",
    "hydra_trio.errors",
    "hydra_trio.config",
}
"""What may sit directly in ``hydra_trio/``: the public API (``__init__`` and its lazy exports), the version, the errors
and the configuration; every layer has its folder."""

LAYERS = (
    "node",
    "transport",
    "observability",
    "client",
    "cli",
    "testing",
    "engine",
    "service",
    "openai",
    "http",
    "hydra",
    "rpc_backend",
    "protocol",
    "validation",
    "models",
    "router",
)

LAYER_ORDER: tuple[tuple[str, ...], ...] = (
    ("protocol",),  # the floor: wire framing and status codes (Hydra, ggml-RPC, the first bytes), nothing else
    ("errors", "_version", "_lazy"),  # the typed errors (each names its Hydra status), the version, lazy exports
    ("validation",),  # strict JSON -> attrs classes, ``host:port``: what reads a peer's values
    ("observability", "transport"),  # the event bus, progress, logs; sockets, TLS, the front door
    ("engine",),  # llama.cpp, slots, batching, the one inbox
    ("models", "openai", "rpc_backend"),  # model files; the OpenAI / llama-server shapes; the ggml-RPC backend
    ("service",),  # what every front end calls: completions, slots, node facts, metrics, stats
    ("http", "hydra"),  # the front ends: decode, route, encode
    ("config",),  # the settings of a whole node
    ("node", "router"),  # the composition root; router mode's (its models' children serve them)
    ("testing", "client"),  # test helpers; the watch client
    ("cli",),  # the command line
    ("", "__main__"),  # the public API (``hydra_trio/__init__.py``) and ``python -m hydra_trio``
)
"""The layers, bottom first.  A module imports only its own layer and the layers listed before its own:
no import runs back up, and two layers of one row know nothing of each other."""


def test_the_top_level_holds_only_the_public_api() -> None:
    top = {n for n in MODULES if n.count(".") <= 1 and not any(n == f"hydra_trio.{layer}" for layer in LAYERS)}
    assert top == TOP_LEVEL, top ^ TOP_LEVEL
    assert {n.split(".")[1] for n in MODULES if n.count(".") >= 2} == set(LAYERS)


def _layer(name: str) -> str:
    return name.split(".")[1] if name.count(".") >= 1 else ""


def _rank(layer: str) -> int:
    return next(i for i, row in enumerate(LAYER_ORDER) if layer in row)


def _imports_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Each ``module -> module`` import of ``graph`` whose target is in another layer of the same row of
    :data:`LAYER_ORDER` or in a later row."""
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _layer(d) != _layer(m) and _rank(_layer(d)) >= _rank(_layer(m))
    )


def test_the_layer_order_names_every_layer_once() -> None:
    named = [layer for row in LAYER_ORDER for layer in row]
    assert len(named) == len(set(named))
    assert set(named) == {_layer(m) for m in MODULES}


def test_no_import_runs_back_up() -> None:
    """Every import of the package goes down :data:`LAYER_ORDER` (or stays in its layer): the codecs are the
    floor and import nothing of the package; the errors know only the codecs' status codes; the engine
    knows no OpenAI shape, service or front end; the service knows no front end; the front ends know
    neither each other nor the composition root."""
    # the check finds what it looks for
    assert _imports_back_up({"hydra_trio.protocol.hydra": {"hydra_trio.errors"}}) == [
        "hydra_trio.protocol.hydra -> hydra_trio.errors"
    ]
    assert _imports_back_up({"hydra_trio.hydra.ops": {"hydra_trio.http.app", "hydra_trio.engine.engine"}}) == [
        "hydra_trio.hydra.ops -> hydra_trio.http.app"
    ]
    assert _imports_back_up({"hydra_trio.errors": {"hydra_trio.protocol.hydra"}}) == []
    assert _imports_back_up({m: _imports(m) for m in MODULES}) == []
    assert {d for m in MODULES if _layer(m) == "protocol" for d in _imports(m) if _layer(d) != "protocol"} == set()


def test_layers() -> None:
    """What :data:`LAYER_ORDER` alone does not say: the observability leaves (events, progress) import
    nothing of the package; nothing of the product imports the test helpers, the CLI or the watch client;
    only the composition root (``node``) and the CLI assemble a whole node."""
    leaves = {"hydra_trio.observability.events", "hydra_trio.observability.progress"}
    for name in MODULES:
        deps = _imports(name)
        layer = _layer(name)
        if layer == "router":  # router mode: children serve the models; the router loads none itself (it
            # serves the Hydra front end's connection loop and gate, and lends compute with the ggml-RPC backend)
            outside = {d for d in deps if _layer(d) in ("engine", "service", "openai")}
            assert outside == set(), f"{name} imports {outside}"
        if name in leaves:
            assert deps == set(), f"{name} imports {deps}"
        if layer != "testing":
            assert not {d for d in deps if _layer(d) == "testing"}, f"{name} imports the test helpers"
        if layer not in ("cli", "testing") and name not in ("hydra_trio.__main__",):
            assert not {d for d in deps if _layer(d) in ("cli", "client")} or layer == "client", (
                f"{name} imports the CLI or the watch client"
            )
        if layer not in ("node", "cli", "testing") and name not in ("hydra_trio", "hydra_trio.__main__"):
            assert not {d for d in deps if _layer(d) == "node"}, f"{name} imports the composition root"


def _imports_of_tests(path: Path) -> list[str]:
    """Lines of ``path`` that import the test suite (``tests`` or ``tests.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found += [f"{path.name}:{node.lineno}" for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_benches_and_the_fuzzer_import_no_test() -> None:
    """``bench/``, ``fuzz/`` and ``examples/`` sit beside the suite, not on it: what they share with it lives in
    ``hydra_trio/testing/``."""
    root = PKG.parent
    found = [
        hit
        for folder in ("bench", "fuzz", "examples")
        for p in sorted((root / folder).rglob("*.py"))
        for hit in _imports_of_tests(p)
    ]
    assert found == []


def _sibling_imports(folder: Path) -> dict[str, set[str]]:
    """``module -> modules of the same folder it imports`` (``from . import x``, ``from .x import y``,
    ``from folder.x import y``), anywhere in the module, for the modules of ``folder``."""
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for p in folder.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 1 or mod.split(".")[0] == folder.name:
                    head = mod.split(".")[-1] if mod and mod != folder.name else ""
                    deps |= {head} if head else {a.name for a in node.names}
        graph[p.stem] = (deps & names) - {p.stem}
    return graph


def test_the_fuzzer_and_the_benches_have_no_import_cycle() -> None:
    """The fuzzer's modules import each other one way (its shared wire helpers are ``fuzz/wire.py``)."""
    for folder in ("fuzz", "bench"):
        graph = _sibling_imports(PKG.parent / folder)
        assert graph, folder
        reach = {m: set(deps) for m, deps in graph.items()}
        for _ in graph:  # the transitive closure: what each module reaches through others
            reach = {m: r.union(*(reach[d] for d in r)) for m, r in reach.items()}
        assert sorted(m for m in graph if m in reach[m]) == [], folder
    assert "wire" in _sibling_imports(PKG.parent / "fuzz")["hostile"]


ENGINE_PUBLIC_MODULES = {
    "hydra_trio.engine": "the engine's public names (hydra_trio/engine/__init__.py)",
    "hydra_trio.engine.settings": "the configuration classes and the bounds requests are checked against",
    "hydra_trio.engine.speculative.settings": "speculative decoding's settings, parsed by the CLI's --spec-* flags",
    "hydra_trio.engine.llama.ggml_backend": "ggml's libraries and devices, for the ggml-RPC server and --list-devices",
    "hydra_trio.engine.llama.bindings": "the llama.cpp bindings, installed once as the package loads",
}
"""The modules of ``hydra_trio/engine/`` that the rest of the package may import, and why."""


def test_the_rest_of_the_package_uses_the_engine_through_its_public_names() -> None:
    """Front ends, the service, the CLI and the node import ``hydra_trio.engine`` (the names its
    ``__init__`` exports: ``Engine``, the tasks, the requests, ``ModelView``...) and the few modules of
    :data:`ENGINE_PUBLIC_MODULES`, never the engine's inner modules; every name they import from
    ``hydra_trio.engine`` is exported there."""
    import hydra_trio.engine as engine

    found = []
    for name in MODULES:
        if name == "hydra_trio.engine" or name.startswith("hydra_trio.engine."):
            continue
        for line, mod, names in _import_statements(name):
            if mod != "hydra_trio.engine" and not mod.startswith("hydra_trio.engine."):
                continue
            if mod not in ENGINE_PUBLIC_MODULES:
                found.append(f"{name}:{line} {mod}")
            elif mod == "hydra_trio.engine":
                found += [f"{name}:{line} hydra_trio.engine.{n}" for n in names if n not in engine.__all__]
    assert "hydra_trio.http.app" in MODULES and "hydra_trio.engine.tasks" in MODULES
    assert found == [], found
    for n in engine.__all__:  # each export finds its object
        getattr(engine, n)


FRONT_ENDS = ("service", "openai", "http", "hydra")
"""The layers that serve requests: they read the served model as a :class:`~hydra_trio.engine.view.ModelView`."""


def _model_reads(tree: ast.AST) -> list[int]:
    """Lines that take llama.cpp's model object from the engine (``e.model``, ``engine.solo_model``,
    ``self.engine.model``...) or name ``LoadedModel``, instead of ``Engine.model_view``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("model", "solo_model"):
            receiver = node.value
            engine = (isinstance(receiver, ast.Name) and receiver.id in ("e", "engine")) or (
                isinstance(receiver, ast.Attribute) and receiver.attr == "engine"
            )
            if engine or node.attr == "solo_model":
                lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "LoadedModel":
            lines.append(node.lineno)
        elif isinstance(node, ast.alias) and node.name == "LoadedModel":
            lines.append(getattr(node, "lineno", 0))
    return sorted(lines)


def test_front_ends_read_the_model_through_its_view() -> None:
    """The service, the OpenAI shapes, HTTP and Hydra use the served model through ``Engine.model_view`` (the
    small :class:`~hydra_trio.engine.view.ModelView`: template, tokenizer, vocabulary, grammar check, facts),
    never ``Engine.model`` / ``Engine.solo_model`` (llama.cpp's handles, the engine thread's own)."""
    assert _model_reads(ast.parse("m = e.solo_model or e.model\nx = self.engine.model.n_vocab\nbody.model")) == [
        1,
        1,
        2,
    ]
    assert _model_reads(ast.parse("from hydra_trio.engine import LoadedModel\nm = e.model_view")) == [1]
    found = {
        name: lines
        for name, path in MODULES.items()
        if name.split(".")[1:2] and name.split(".")[1] in FRONT_ENDS
        if (lines := _model_reads(ast.parse(path.read_text())))
    }
    assert found == {}, found


def _error_classes() -> set[str]:
    """The names of the package's exception classes (a class whose bases lead to ``Exception``)."""
    bases = {
        node.name: {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
        for tree in TREES.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    errors = {"BaseException", "Exception", "ValueError", "TypeError", "RuntimeError", "OSError", "ConnectionError"}
    while more := {n for n, b in bases.items() if n not in errors and b & errors}:
        errors |= more
    return errors & set(bases)


def _second_names(tree: ast.AST, errors: set[str]) -> list[str]:
    """Where a module gives one of ``errors`` another name: ``Alias = SomeError`` or ``import SomeError as
    Alias``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)):
            value = ast.unparse(node.value).rsplit(".", 1)[-1]
            if value in errors:
                found += [f"{node.lineno}: {ast.unparse(t)} = {value}" for t in node.targets]
        elif isinstance(node, ast.alias) and node.asname not in (None, node.name) and node.name in errors:
            found.append(f"{node.lineno}: {node.name} as {node.asname}")
    return found


def test_each_error_class_has_one_name() -> None:
    """One error, one name: no module binds an error class of the package to a second name (an alias such as
    ``RequestError = MessageError``, or ``import X as Y``), so a search for the name finds every use."""
    errors = _error_classes()
    assert {"MessageError", "InvalidRequest", "HydraError", "StateError"} <= errors
    sample = "RequestError = msg.MessageError\nfrom x import Busy as Refused\nLIMIT = MAX\nfrom y import Busy"
    assert _second_names(ast.parse(sample), errors) == ["1: RequestError = MessageError", "2: Busy as Refused"]
    found = {name: lines for name, tree in TREES.items() if (lines := _second_names(tree, errors))}
    assert found == {}, found


def _public_type_names(name: str) -> set[str]:
    """The public classes and type aliases (``X: TypeAlias = ...``) a module defines, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ClassDef):
            out.add(node.name)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and "TypeAlias" in ast.unparse(node.annotation)
        ):
            out.add(node.target.id)
    return {n for n in out if not n.startswith("_")}


def test_no_public_class_name_is_defined_twice() -> None:
    """One name per concept: a public class (or type alias) name finds one definition in the package."""
    where: dict[str, list[str]] = {}
    for name in MODULES:
        for cls in _public_type_names(name):
            where.setdefault(cls, []).append(name)
    assert "HydraTrioError" in where and "RpcReplyEvent" in where  # the scan sees classes and aliases
    twice = {cls: sorted(mods) for cls, mods in where.items() if len(mods) > 1}
    assert twice == {}, twice


ENGINE_DOORS = {"call", "run_task", "execute", "post", "run_in_engine", "Call"}
"""Callables through which work could reach the engine thread (``Engine.run_task``, a bridge ``Call``, and
the names of doors the engine no longer has)."""


def _lambdas_handed_to_the_engine(tree: ast.AST) -> list[int]:
    """Lines where a lambda is an argument of a call to one of :data:`ENGINE_DOORS`."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ENGINE_DOORS and any(
            isinstance(a, ast.Lambda) for a in [*node.args, *(k.value for k in node.keywords)]
        ):
            lines.append(node.lineno)
    return lines


def test_no_lambda_is_handed_to_the_engine_from_outside_it() -> None:
    """Work reaches the engine as typed tasks (hydra_trio/engine/tasks.py), never as an anonymous function:
    outside ``hydra_trio/engine/`` no lambda is passed to ``.call(``, ``.run_task(``, ``Call(``..."""
    # the scan finds what it looks for
    assert _lambdas_handed_to_the_engine(ast.parse("e.call(lambda engine: engine.save_slot(0))")) == [1]
    assert _lambdas_handed_to_the_engine(ast.parse("Call(fn=lambda: e.peer_gone())")) == [1]
    assert _lambdas_handed_to_the_engine(ast.parse("e.run_task(SaveSlot(0)); f(lambda: 1)")) == []
    found = {}
    for name, path in MODULES.items():
        if name == "hydra_trio.engine" or name.startswith("hydra_trio.engine."):
            continue
        lines = _lambdas_handed_to_the_engine(ast.parse(path.read_text()))
        if lines:
            found[name] = lines
    assert "hydra_trio.hydra.ops" in MODULES and "hydra_trio.engine.tasks" in MODULES
    assert found == {}, found


def test_the_engine_has_one_inbox_and_one_door_for_work() -> None:
    """Work reaches the engine thread only as typed tasks on its one inbox: :meth:`Engine.run_task` (a result
    back), :meth:`Engine.submit` and :meth:`Engine.cancel` (a completion's start and cancel); an engine-wide
    change is an exclusive task, not a second queue (no control-channel module, no ``call``/``post``)."""
    from hydra_trio.engine.engine import Engine

    assert "hydra_trio.engine.control" not in MODULES
    assert not hasattr(Engine, "call") and not hasattr(Engine, "post")
    assert {"run_task", "submit", "cancel"} <= set(vars(Engine))


def test_every_import_of_the_package_finds_its_module() -> None:
    """``from .x import y`` / ``import hydra_trio.x`` name a module that exists (a stale path after a move
    would otherwise only fail when that line runs)."""
    missing = [
        f"{name}:{line} {mod}"
        for name in MODULES
        for line, mod, _names in _import_statements(name)
        if mod.startswith("hydra_trio") and mod not in MODULES
    ]
    assert missing == []


def _top_level_names(name: str) -> set[str] | None:
    """The names module ``name`` binds at its top level (definitions, assignments, imports, ``if`` / ``try``
    bodies); None when it has a module ``__getattr__`` (its names are lazy)."""
    out: set[str] = set()
    body = list(ast.parse(MODULES[name].read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for tg in targets for n in ast.walk(tg) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            body += [
                *node.body,
                *getattr(node, "orelse", []),
                *getattr(node, "finalbody", []),
                *(s for h in getattr(node, "handlers", []) for s in h.body),
            ]
    return None if "__getattr__" in out else out


def test_every_name_imported_from_the_package_exists() -> None:
    """``from hydra_trio.x import y`` names a ``y`` that ``x`` binds (or a submodule): a renamed function
    otherwise only fails when the importing module loads."""
    missing = []
    for name in MODULES:
        for line, mod, names in _import_statements(name):
            if not mod.startswith("hydra_trio") or mod not in MODULES:
                continue
            bound = _top_level_names(mod)
            if bound is None:
                continue
            missing += [
                f"{name}:{line} {mod}.{n}" for n in names if n != "*" and n not in bound and f"{mod}.{n}" not in MODULES
            ]
    assert missing == []


ROUTE_MODULES = (
    "hydra_trio.http.app",
    "hydra_trio.http.completions",
    "hydra_trio.http.slots",
    "hydra_trio.http.native",
    "hydra_trio.http.events",
    "hydra_trio.hydra.ops",
    "hydra_trio.hydra.connection",
    "hydra_trio.hydra.gate",
)
"""The modules that answer requests (HTTP routes, Hydra ops and their dispatch)."""


def _literal_statuses(tree: ast.AST) -> list[str]:
    """Error statuses written out: an int from 400 to 599 (an HTTP error status) or a ``Status.X`` other than
    ``Status.OK`` (a Hydra error status)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int and 400 <= node.value <= 599:
            found.append(f"{node.lineno}: {node.value}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Status"
            and node.attr != "OK"
        ):
            found.append(f"{node.lineno}: Status.{node.attr}")
    return found


def test_routes_write_no_error_status_of_their_own() -> None:
    """One error boundary per front end: a route refuses by raising a typed error (hydra_trio/errors.py), whose
    class names its HTTP and Hydra status; only the boundary (hydra_trio/http/errors.py for HTTP,
    ``ServerConnection.handle`` for Hydra) turns it into a reply.  No route module writes a status itself."""
    assert _literal_statuses(ast.parse("error_response(404, 'x')")) == ["1: 404"]
    assert _literal_statuses(ast.parse("raise Reply(Status.NOT_FOUND, 'x')")) == ["1: Status.NOT_FOUND"]
    assert _literal_statuses(ast.parse("send(Status.OK, exc.http_status); sleep(4096)")) == []
    found = {}
    for name in ROUTE_MODULES:
        lines = _literal_statuses(ast.parse(MODULES[name].read_text()))
        if lines:
            found[name] = lines
    assert found == {}, found
