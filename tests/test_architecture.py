"""The structure docs/design.md §11 and CONTRIBUTING.md declare, checked on the source: no import cycles
between nitrobrew's modules (function-level imports included), no module importing an underscore name of
another loss family, the losses never importing the benchmark harness, and the public losses written out."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nitrobrew"
FAMILIES = ("hidden", "topk", "attention", "parallel", "hf", "teacher", "integrations")
LOSS_FAMILIES = ("hidden", "topk", "attention")
APPLICATIONS = ("teacher", "hf", "bench", "demo", "cli", "environment", "integrations")
# Old import paths kept for one release; each only re-exports its new home, with a DeprecationWarning.
DEPRECATED_SHIMS = {f"nitrobrew.topk.{m}" for m in ("data", "extract", "store", "interop", "verify", "inputs")}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path):
    """(imported module, names) of every import in the file, relative imports resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            for n in names:  # "from . import kernels" imports a module
                sub = f"{target}.{n}"
                if (PKG.parent / (sub.replace(".", "/") + ".py")).exists():
                    yield sub, []
            yield target, names


def graph():
    files = sorted(PKG.rglob("*.py"))
    mods = {module_name(f) for f in files}
    edges = {}
    for f in files:
        src = module_name(f)
        edges[src] = {t for t, _ in imports(f) if t in mods and t != src}
    return edges


def test_no_import_cycles():
    edges = graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    # a package's __init__ re-exporting its submodules is not a cycle of code
    real = [c for c in cycles if not any(c[i + 1].startswith(c[i] + ".") for i in range(len(c) - 1))]
    assert not real, "import cycles:\n" + "\n".join(" -> ".join(c) for c in real)


def test_no_private_names_across_families():
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        src = module_name(f)
        src_family = src.split(".")[1] if src.count(".") >= 1 else ""
        for target, names in imports(f):
            parts = target.split(".")
            if len(parts) < 2 or parts[0] != "nitrobrew" or parts[1] not in FAMILIES or parts[1] == src_family:
                continue
            private = [n for n in names if n.startswith("_")] + [p for p in parts[2:] if p.startswith("_")]
            if private:
                bad.append(f"{src} imports {private} from {target}")
    assert not bad, "\n".join(bad)


def test_losses_never_import_the_bench():
    for f in sorted(PKG.rglob("*.py")):
        src = module_name(f)
        if src.split(".")[1:2] in (["bench"], ["demo"], ["cli"]):
            continue
        assert not any(t.startswith("nitrobrew.bench") for t, _ in imports(f)), src


def test_public_losses_are_written_out():
    api = (PKG / "hidden" / "api.py").read_text()
    from nitrobrew import divergences as dv

    for name in dv.NAMES:
        assert f"\ndef {name}(" in api, name
    modules = (PKG / "hidden" / "modules.py").read_text()
    assert "type(name" not in modules and modules.count("(DistillLoss):") == len(dv.NAMES)


def _nitrobrew_imports(f: Path):
    return {t for t, _ in imports(f) if t.startswith("nitrobrew.")}


def test_parallel_imports_no_family():
    """parallel/ (collectives, rank checks, data-parallel normalization) sits below the loss families."""
    bad = []
    for f in sorted((PKG / "parallel").rglob("*.py")):
        for t in _nitrobrew_imports(f):
            part = t.split(".")[1] if t.count(".") else ""
            if part in LOSS_FAMILIES + APPLICATIONS:
                bad.append(f"{module_name(f)} imports {t}")
    assert not bad, "\n".join(bad)
    # the deprecated names it still hands out come from the families' vocab_parallel modules only
    from nitrobrew import parallel

    assert set(parallel._MOVED.values()) == {"nitrobrew.hidden.vocab_parallel", "nitrobrew.topk.vocab_parallel"}


def test_core_is_the_bottom():
    """core/ and divergences.py import nothing of nitrobrew but each other."""
    bad = []
    files = sorted((PKG / "core").rglob("*.py")) + [PKG / "divergences.py"]
    for f in files:
        for t in _nitrobrew_imports(f):
            if not (t.startswith("nitrobrew.core") or t == "nitrobrew.divergences"):
                bad.append(f"{module_name(f)} imports {t}")
    assert not bad, "\n".join(bad)
    assert not [p.name for p in PKG.glob("_*.py") if p.name != "__init__.py"], "the core lives in core/"


def test_losses_never_import_the_applications():
    bad = []
    for family in LOSS_FAMILIES + ("parallel", "core"):
        for f in sorted((PKG / family).rglob("*.py")):
            if module_name(f) in DEPRECATED_SHIMS:
                continue
            for t in _nitrobrew_imports(f):
                part = t.split(".")[1] if t.count(".") else ""
                if part in APPLICATIONS:
                    bad.append(f"{module_name(f)} imports {t}")
    assert not bad, "\n".join(bad)


def test_deprecated_paths_warn_and_point_home():
    import importlib
    import sys
    import warnings

    for mod in sorted(DEPRECATED_SHIMS):
        sys.modules.pop(mod, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = importlib.import_module(mod)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), mod
        home = importlib.import_module(mod.replace("nitrobrew.topk.", "nitrobrew.teacher."))
        public = [
            n for n in vars(home) if not n.startswith("_") and getattr(vars(home)[n], "__module__", "") == home.__name__
        ]
        assert public and all(getattr(m, n) is getattr(home, n) for n in public), mod
