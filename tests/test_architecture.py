"""The folders are the architecture: imports run one way (serve -> relay / sweep -> diagnosis ->
wire / servers / observers -> record / config), with no circle, drawn here from the code's own imports."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "proxy"
LEAVES = {"proxy", "record", "config", "processes"}  # `proxy` itself: its __init__ (the version)
ALLOWED: dict[str, set[str]] = {
    "record": set(), "config": set(), "processes": set(),
    "wire": {"record", "config", "processes"},
    "servers": {"record", "config", "processes", "wire"},
    "observers": {"record", "config", "processes", "wire", "servers"},
    "diagnosis": {"record", "config", "processes", "wire", "servers", "observers"},
    "relay": {"record", "config", "processes", "wire", "servers", "observers", "diagnosis"},
    "sweep": {"record", "config", "processes", "wire", "servers", "observers", "diagnosis"},
    "simulator": {"config"},
    "serve": {"record", "config", "processes", "wire", "servers", "observers", "diagnosis", "relay", "sweep",
              "simulator"},
    "__main__": {"serve"},
}
# What the relay must know nothing of (DEVELOPERS.md): metrics, NVML, dialects, classification.
RELAY_MUST_NOT = ("prometheus_client", "pynvml", "proxy.wire.dialects", "proxy.diagnosis.classify",
                  "proxy.observers.metrics", "proxy.observers.telemetry")


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (a late import is an import)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "proxy"


def graph() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(path) if m.split(".")[0] == "proxy" and m != name}
            for name, path in modules()}


def test_imports_run_one_way_between_the_folders() -> None:
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        for target in targets:
            theirs = layer(target)
            if theirs != own and theirs != "proxy" and theirs not in ALLOWED[own]:
                wrong.append(f"{module} imports {target} ({own} -> {theirs})")
    assert not wrong, "\n".join(sorted(wrong))


def test_there_is_no_import_circle() -> None:
    edges = graph()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in edges:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    assert circles == []


def test_the_relay_knows_nothing_of_metrics_nvml_dialects_or_classification() -> None:
    wrong = [f"{name} imports {target}" for name, path in modules() if layer(name) == "relay"
             for target in imports_of(path) if target.startswith(RELAY_MUST_NOT)]
    assert not wrong, "\n".join(wrong)


def test_the_top_level_holds_at_most_ten_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    assert {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"} <= LEAVES


def test_every_folder_says_what_it_owns_and_what_it_must_not_import() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "must not import" in doc.lower(), f"{init.relative_to(ROOT)}: no word on what it must not import"


def _record_writes(path: Path) -> Iterator[str]:
    """Assignments to a record's fields: `<something named record>.<field> = ...`, a setattr on a
    record, or an append to its notes."""
    from proxy.record import RECORD_FIELDS

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets
                       for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr in RECORD_FIELDS
                    and "rec" in ast.unparse(target.value).lower()):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)} = ..."
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called == "setattr" and node.args and "rec" in ast.unparse(node.args[0]).lower():
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
            if called.endswith("observer_errors.append"):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {called}(...)"


def test_only_the_diagnosis_writes_a_record() -> None:
    wrong = [write for name, path in modules() if layer(name) != "diagnosis" for write in _record_writes(path)]
    assert not wrong, "\n".join(wrong)


def test_the_writes_check_would_see_a_write() -> None:
    writes = [w for name, path in modules() if layer(name) == "diagnosis" for w in _record_writes(path)]
    assert any("recorder.py" in w for w in writes) and any("delivery.py" in w for w in writes)


# --- each server in one module ----------------------------------------------------------------------
SERVER_KINDS = frozenset({"vllm", "llamacpp", "ollama", "sglang"})
ABOUT_A_SERVER = ("kind", "source", "owner", "server", "facts", "identity", "mode")


def _kinds_named(node: ast.expr) -> set[str]:
    """The server kinds a literal names: a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & SERVER_KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in SERVER_KINDS}
    return set()


def server_branches(path: Path) -> Iterator[str]:
    """Comparisons of something about a server (its kind, source, owner...) with a server kind's name,
    and tables keyed by server kinds: what belongs in that server's module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = set().union(*(_kinds_named(side) for side in sides))
            other = " ".join(ast.unparse(side) for side in sides if not _kinds_named(side)).lower()
            if named and any(word in other for word in ABOUT_A_SERVER):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in SERVER_KINDS}
            if len(keys) >= 2:
                yield f"{path.relative_to(ROOT)}:{node.lineno}: a table keyed by server kinds {sorted(keys)}"


def test_no_module_outside_servers_branches_on_a_server_kind() -> None:
    wrong = [branch for name, path in modules() if layer(name) not in ("servers", "simulator")
             for branch in server_branches(path)]
    assert not wrong, "\n".join(wrong)


def test_the_branch_check_would_see_a_branch(tmp_path: Path) -> None:
    probe = tmp_path / "module.py"
    probe.write_text('if facts.kind == "vllm":\n    pass\nx = kind in ("ollama", "sglang")\n'
                     'T = {"vllm": 1, "llamacpp": 2}\nok = record.dialect == "ollama"\n')
    found = list(server_branches_of(probe))
    assert len(found) == 3 and not any("dialect" in line for line in found)


def server_branches_of(path: Path) -> Iterator[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        yield from server_branches(path)
    finally:
        ROOT = saved


def test_every_server_module_says_what_it_is() -> None:
    from proxy.servers import SERVERS

    assert {server.kind for server in SERVERS} == SERVER_KINDS
    for server in SERVERS:
        module = sys.modules[type(server).__module__]
        assert module.__file__ is not None and Path(module.__file__).stem == server.kind
        doc = module.__doc__ or ""
        assert server.name in doc and ("/" in doc or ".py" in doc), f"{server.kind}: no source links in its docstring"


# --- names that mean one thing ------------------------------------------------------------------------
# A name retired because it meant two or three things, and what says it now.
RETIRED = {
    "ByteBudget": "ParseBytes (bytes held for parsing; a budget is tokens)", "byte_budget": "parse_bytes",
    "parse_budget": "parse_bytes", "parse_budget_bytes": "parse_bytes_max",
    "ServerFacts": "ServerIdentity", "SERVER_FACTS": "DURING_FIELDS", "ServerFact": "DuringField",
    "facts_for": "during", "ServerFactsProbe": "IdentityPoller", "UpstreamProbe": "UpstreamReachability",
    "probe": "a name for what it asks (identity, reachable, trial)", "WorkerPool": "WorkerSupervisor",
    "chain": "delivery", "compact_once": "the CompactOnce a delivery passes to its observers",
    "_json_sink": "logs.json_sink()", "CLIENT_GONE": "Stop.CLIENT_LEFT", "client_gone": "client_has_left",
    "body_stopped": "body_ended",
}


def identifiers(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.asname or node.name.rpartition(".")[2]


def test_retired_names_are_gone() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name} (now: {RETIRED[name]})"
             for _, path in modules() for line, name in identifiers(path) if name in RETIRED]
    assert not wrong, "\n".join(wrong)


def test_a_budget_is_tokens_and_bytes_held_are_not_a_budget() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name}" for _, path in modules() for line, name in identifiers(path)
             if "budget" in name.lower() and any(word in name.lower() for word in ("byte", "parse", "held"))]
    assert not wrong, "\n".join(wrong)


def test_the_delivery_is_called_delivery_everywhere() -> None:
    """A parameter or attribute that holds the Delivery is named for it, never `observers` or `chain`."""
    wrong = []
    for _, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.annotation is not None and ast.unparse(node.annotation) == "Delivery":
                if node.arg.lstrip("_") != "delivery":
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}: Delivery")
            elif isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "Delivery":
                name = ast.unparse(node.target).rpartition(".")[2]
                if name.lstrip("_") != "delivery":
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}: Delivery")
    assert not wrong, "\n".join(wrong)


def test_shared_constants_cannot_be_changed_by_their_users() -> None:
    """The events every parse shares are tuples: one `append` to a shared list would corrupt every
    later parse."""
    from proxy.wire import events, fast_tokens

    assert isinstance(events.NO_EVENTS, tuple)
    assert all(isinstance(value, tuple) for value in fast_tokens.EVENTS.values())
