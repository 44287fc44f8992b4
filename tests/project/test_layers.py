"""The layer check (docs/architecture.md): every module of the library imports
only from its own layer or the layers below it.

    kvcore/*.py          public classes      may import anything below, never kvcore.cli
    kvcore/_native/      bookkeeping         kvcore._native, kvcore._errors, kvcore._ints
    kvcore/backends/     data movement       kvcore.backends, kvcore.dtypes, kvcore._errors,
                                             kvcore._ints,
                                             and the shared C types kvcore._native._typedefs
    kvcore/cli/          demo and benchmarks anything (kvcore/__main__.py only calls it)

Imports are read from the source (``ast`` for .py, the import and cimport
statements for .pyx/.pxd), so the check runs without building anything and
fails on the first module that reaches upward.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvcore"

pytestmark = pytest.mark.skipif(not PKG.is_dir(), reason="needs the source tree")

# (layer, the kvcore modules it may import: exact names or prefixes ending in ".")
LAYERS = {
    "native": ("kvcore._native.", "kvcore._errors", "kvcore._ints"),
    "backends": ("kvcore.backends.", "kvcore.backends", "kvcore.dtypes", "kvcore._errors",
                 "kvcore._ints",
                 "kvcore._native._typedefs"),
    "cli": ("kvcore",),
    "public": ("kvcore",),           # anything ...
}
NEVER_FROM_LIBRARY = "kvcore.cli"    # ... but the library never imports the CLI

_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+([\w.]+)\s+c?import\b|c?import\s+([\w.]+(?:\s*,\s*[\w.]+)*))", re.M)


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module):
    if module in ("kvcore.cli", "kvcore.__main__") or module.startswith("kvcore.cli."):
        return "cli"
    if module.startswith("kvcore._native"):
        return "native"
    if module.startswith("kvcore.backends"):
        return "backends"
    return "public"


def _resolve(module, path, level, name):
    """The absolute module a relative import in ``module`` names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def _is_module(name):
    where = PKG.parent / name.replace(".", "/")
    return where.is_dir() or any(where.with_suffix(x).exists() for x in (".py", ".pyx"))


def imports(path):
    """Every kvcore module ``path`` imports (``from X import y`` counts as
    X.y when X is a package, so ``from . import dtypes`` names the module)."""
    module = module_name(path)
    found = set()
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve(module, path, node.level, node.module) if node.level
                        else node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if _is_module(sub) else base)
    else:
        for m in _CYTHON_IMPORT.finditer(path.read_text(encoding="utf-8")):
            if m.group(1):
                found.add(m.group(1))
            else:
                found.update(n.strip() for n in m.group(2).split(","))
    return {f for f in found if f == "kvcore" or f.startswith("kvcore.")}


def allowed(layer, target):
    if layer != "cli" and (target == NEVER_FROM_LIBRARY or target.startswith("kvcore.cli.")):
        return False
    return any(target == rule or (rule.endswith(".") and target.startswith(rule))
               or (rule == "kvcore") for rule in LAYERS[layer])


def sources():
    return sorted(p for p in PKG.rglob("*") if p.suffix in (".py", ".pyx", ".pxd"))


def upward_imports():
    bad = []
    for path in sources():
        module = module_name(path)
        layer = layer_of(module)
        for target in sorted(imports(path)):
            if not allowed(layer, target):
                bad.append(f"{path.relative_to(ROOT)} ({layer}) imports {target}")
    return bad


def test_no_module_imports_upward():
    assert sources(), "no sources found"
    bad = upward_imports()
    assert not bad, "imports across the layers (see docs/architecture.md):\n" + "\n".join(bad)


def test_the_check_sees_every_layer():
    layers = {layer_of(module_name(p)) for p in sources()}
    assert layers == {"public", "native", "backends", "cli"}


def test_importing_the_library_imports_no_cli():
    """What the static check promises, seen at run time in a fresh process:
    ``import kvcore`` and then every module of the library (stores, hf,
    both backends) leave ``kvcore.cli`` out of ``sys.modules``; only
    ``python -m kvcore`` reaches it."""
    import json
    import subprocess
    import sys

    names = sorted({module_name(p) for p in sources() if p.suffix != ".pxd"
                    and layer_of(module_name(p)) != "cli"})
    code = ("import importlib, json, sys\n"
            "import kvcore\n"
            "first = sorted(m for m in sys.modules if m.startswith('kvcore.cli'))\n"
            "missing = []\n"
            f"for name in {names!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        missing.append(name)\n"
            "every = sorted(m for m in sys.modules if m.startswith('kvcore.cli'))\n"
            "print(json.dumps([first, every, missing]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    first, every, missing = json.loads(out)
    assert first == [] and every == []
    # only kvcore.hf has optional imports (torch, transformers) of its own
    # (without torch/transformers the kvcore.hf package cannot import: its modules only)
    assert all(m == "kvcore.hf" or m.startswith("kvcore.hf.") for m in missing), missing
    assert "kvcore.hf" in names and "kvcore.stores.disk" in names and "kvcore.cli" not in names


@pytest.mark.parametrize("layer, target, ok", [
    ("native", "kvcore.backends.cpu._kernels", False),
    ("native", "kvcore.pool", False),
    ("native", "kvcore._native._pool", True),
    ("backends", "kvcore._native._pool", False),
    ("backends", "kvcore._native._typedefs", True),
    ("backends", "kvcore.dtypes", True),
    ("backends", "kvcore._arrays", False),
    ("public", "kvcore.cli.demo", False),
    ("public", "kvcore.backends", True),
    ("cli", "kvcore.cli.model", True),
])
def test_the_rules_can_fail(layer, target, ok):
    assert allowed(layer, target) is ok


def test_imports_are_read_from_python_and_cython(tmp_path):
    # the reader finds relative, absolute and Cython imports alike
    seq = PKG / "_native" / "_seq.pyx"
    assert "kvcore._native._pool" in imports(seq)
    pool = PKG / "pool.py"
    assert {"kvcore.backends", "kvcore._native._pool"} <= imports(pool)


def test_attention_imports_no_backend_internals():
    """kvcore/attention.py validates and delegates to the pool's backend
    (Backend.attention_plan / attention_run): it imports the backends
    package, never a backend's modules."""
    got = imports(PKG / "attention.py")
    assert "kvcore.backends" in got          # (the reader sees its imports)
    inside = sorted(t for t in got if t.startswith("kvcore.backends."))
    assert not inside, f"kvcore/attention.py imports backend internals: {inside}"


# a prefix tier never reaches into the pool or a sequence: no core, and no
# underscore field of a pool, a sequence or their cores (comments and
# docstrings included: a docstring naming a private field is a hint that
# somebody reads it)
_PRIVATE_REACH = re.compile(
    r"\b(?:pool|seq|sequence|core|binding|BlockPool|PagedKVCache|SeqCore|PoolCore)\._\w+"
    r"|\b(?!self\b)\w+\._(?:core|seq|table|salt|num_tokens|num_held|num_computed|hash_words"
    r"|token_ids|adopt_loaded|take_held_records|root_salts|salt_roots|storage|scales|backend"
    r"|binding|stores|lock|port|export_blocks|import_blocks)\b")


def private_reaches(text):
    return _PRIVATE_REACH.findall(text)


def assert_none_offend(paths, finder, what):
    """No file of ``paths`` has text in which ``finder`` finds something;
    else fail with ``what`` and {file: what was found}."""
    found = {str(p.relative_to(ROOT)): sorted(set(finder(p.read_text(encoding="utf-8"))))
             for p in paths}
    offenders = {name: hits for name, hits in found.items() if hits}
    assert not offenders, f"{what}: {offenders}"


def test_stores_reach_no_private_field_of_the_pool_or_a_sequence():
    assert_none_offend(sorted((PKG / "stores").glob("*.py")), private_reaches,
                       "kvcore/stores reaches into private fields")


# The stores consume what the pool publishes and answer what it asks
# (docs/stores.md, "The pool's store port"): they import nothing of the
# pool's side and call nothing on a pool, a sequence or a port beyond the
# port's record queue, handed to them once.
STORES_MAY_IMPORT = ("kvcore.stores", "kvcore.stores.", "kvcore.backends", "kvcore._forksafe",
                     "kvcore._ints")
# what a tier is given of the pool's port (its record queue and layout)
# (headroom: the consumer's setting of the room left before each payload)
PORT_GIVEN = {"listen", "layout", "block_size", "bytes_per_block", "headroom"}
_HOLDS_POOL_SIDE = re.compile(r"(?:^|[._])(?:pool|seq|sequence|binding|core)(?:\(\))?$")
_HOLDS_PORT = re.compile(r"(?:^|[._])port$")


def calls_up(source):
    """``x.member`` uses, in code, where ``x`` holds a pool, a sequence, a
    binding or a core (a name or attribute so called, or a weak reference's
    call), or a store port beyond what a tier is given of it."""
    found = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute):
            holder = ast.unparse(n.value)
            if _HOLDS_POOL_SIDE.search(holder) or (_HOLDS_PORT.search(holder)
                                                  and n.attr not in PORT_GIVEN):
                found.add(f"{holder}.{n.attr}")
    return sorted(found)


def test_stores_never_call_back_into_the_pool():
    files = sorted((PKG / "stores").glob("*.py"))
    assert any(p.name == "_spill.py" for p in files)
    bad_imports = {str(p.relative_to(ROOT)): sorted(
        t for t in imports(p) if not any(t == r or (r.endswith(".") and t.startswith(r))
                                         for r in STORES_MAY_IMPORT)) for p in files}
    bad_imports = {k: v for k, v in bad_imports.items() if v}
    assert not bad_imports, f"kvcore/stores imports the pool's side: {bad_imports}"
    assert_none_offend(files, calls_up, "kvcore/stores calls into a pool or a sequence")


@pytest.mark.parametrize("source, bad", [
    ("blocks = pool.probe(tokens)", True),
    ("seq.block_hashes()", True),
    ("src_pool.import_blocks(ids, pays)", True),
    ("port.export_blocks(ids)", True),
    ("self._pool().copy_blocks_to(p, a, b)", True),
    ("n = self.pool.num_blocks", True),
    ("q = port.listen(self._wake)", False),
    ("fp = port.layout['dtype']", False),
    ("workers.submit(job)", False),
    ("self.stats()", False),
])
def test_the_call_up_rule_can_fail(source, bad):
    assert bool(calls_up(source)) is bad


# ---------------------------------------------------------------- no import cycles
def import_graph(paths):
    """{module: the kvcore modules it imports}, module-level and
    function-level imports alike, but not a module's import of one of its
    own packages (``from . import X`` in a package's submodule: Python runs
    the package before its submodules, so that edge never closes a loop at
    import time, and the package is the submodule's own room)."""
    graph = {}
    for p in paths:
        m = module_name(p)
        graph[m] = {t for t in imports(p) if t != m and not m.startswith(t + ".")}
    return graph


def cycles(graph):
    """The strongly connected sets of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """No loop of imports among kvcore's modules, module-level or inside a
    function: data flows down (the pool publishes to its stores, a store
    never calls back up), so nothing lower needs anything higher."""
    found = cycles(import_graph(sources()))
    assert not found, "import cycles among kvcore modules:\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_the_cycle_check_can_fail(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a function-level import counts (main 0e46776: attention -> pool ->
    # stores._tiers -> paged -> attention, each upward edge inside a function)
    pool = tmp_path / "pool.py"
    pool.write_text("def f():\n    from .attention import x\n")
    assert "kvcore.attention" in imports_of_text(pool)


def imports_of_text(path):
    """``imports`` of a file outside the tree, read as kvcore/pool.py."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.add(_resolve("kvcore.pool", PKG / "pool.py", node.level, node.module))
    return found


@pytest.mark.parametrize("line, bad", [
    ("blocks = pool._core.take_evicted()", True),
    ("hw = seq._seq.hash_words()", True),
    ("n = s._seq.num_tokens", True),
    ("table = core._table", True),
    ("salt = pool._root_salts.get(root)", True),
    ("rows = other_pool._storage[0]", True),
    ("x = self._stats[i]", False),
    ("with self._lock:", False),
    ("v = _format.encode(fp)", False),
    ("pays = pool.export_blocks(ids)", False),
])
def test_the_private_reach_rule_can_fail(line, bad):
    assert bool(private_reaches(line)) is bad


# A def (or cpdef) of a Python-visible name ending in _q, in a .pyx file
_PYX_TWIN = re.compile(r"^\s*c?p?def\s+(?:\w+\s+)?([A-Za-z]\w*_q)\s*\(", re.M)


def public_twins(path):
    """Python-visible functions and methods of ``path`` whose name ends in
    ``_q``: a low-precision twin of a data op (one op per verb: the storage
    format is an argument, docs/architecture.md)."""
    if path.suffix == ".py":
        tree = ast.parse(path.read_text())
        nodes = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef)
                                   for n in c.body]
        return sorted(f"{path.name}:{n.name}" for n in nodes
                      if isinstance(n, ast.FunctionDef) and n.name.endswith("_q")
                      and not n.name.startswith("_"))
    text = path.read_text()
    return sorted(f"{path.name}:{m.group(1)}" for m in _PYX_TWIN.finditer(text)
                  if not re.match(r"\s*cdef\s", m.group(0)))


def test_no_backend_op_has_a_low_precision_twin():
    files = sorted(p for p in (PKG / "backends").rglob("*") if p.suffix in (".py", ".pyx"))
    assert any(p.name == "base.py" for p in files)
    bad = [t for p in files for t in public_twins(p)]
    assert not bad, f"backend ops with a _q twin (take a Codec instead): {bad}"


def test_the_twin_check_can_fail(tmp_path):
    py = tmp_path / "b.py"
    py.write_text("class B:\n    def gather_q(self):\n        pass\n\n    def _claim_q(self):\n"
                  "        pass\n\n\ndef write_q():\n    pass\n")
    assert public_twins(py) == ["b.py:gather_q", "b.py:write_q"]
    pyx = tmp_path / "k.pyx"
    pyx.write_text("def write_slots_q(a):\n    pass\ncdef object _x_q(a):\n    pass\n"
                   "cdef void loop_q(int a) noexcept nogil:\n    pass\n"
                   "cpdef int gather_q(int a):\n    return a\n")
    assert public_twins(pyx) == ["k.pyx:gather_q", "k.pyx:write_slots_q"]


# ---------------------------------------------------------------- no side doors
# The public layer (kvcore/*.py, kvcore/stores/) reaches the backends only
# through the package kvcore.backends (get_backend, the backend object's ops
# and what the package exports): never a device backend's package or module
# (kvcore.backends.cpu, kvcore.backends.cuda and below), nor a private module
# of the backends layer.
_BACKEND_INTERNAL = re.compile(r"^kvcore\.backends\.(?:(?:cpu|cuda)(?:\.|$)|(?:\w+\.)*_\w+$)")


def public_sources():
    return sorted(list(PKG.glob("*.py")) + list((PKG / "stores").glob("*.py"))
                  + list((PKG / "hf").glob("*.py")))


def backend_internal_imports(path):
    return sorted(t for t in imports(path) if _BACKEND_INTERNAL.match(t))


def test_public_modules_import_no_backend_internals():
    files = public_sources()
    assert {"pool.py", "_arrays.py", "_format.py", "__init__.py"} <= {p.name for p in files}
    bad = {str(p.relative_to(ROOT)): backend_internal_imports(p) for p in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"public modules import backend internals (use kvcore.backends): {bad}"


@pytest.mark.parametrize("target, bad", [
    ("kvcore.backends", False),
    ("kvcore.backends.codec", False),
    ("kvcore.backends.cpu", True),
    ("kvcore.backends.cpu._kernels", True),
    ("kvcore.backends.cpu.backend", True),
    ("kvcore.backends.cuda", True),
    ("kvcore.backends.cuda.backend", True),
    ("kvcore.backends._helpers", True),
    ("kvcore.backends.cpuish", False),
])
def test_the_backend_internal_rule_can_fail(target, bad):
    assert bool(_BACKEND_INTERNAL.match(target)) is bad


# A public class calls the backend of its device and never branches on the
# device name: a comparison with "cpu"/"cuda" (==, !=, in, startswith) is a
# backend decision made in the wrong layer.  The places that must ask,
# with why:
DEVICE_BRANCH_ALLOWED = {
    ("torch_bridge.py", "_on_cuda"): "the torch side of a pool: torch's allocator, streams and "
                           "tensor constructors differ per device, and no kvcore backend "
                           "knows torch",
}
_DEVICE_WORDS = ("cpu", "cuda")


def _is_device_word(node):
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value.strip().lower() in _DEVICE_WORDS
        or node.value.strip().lower().startswith("cuda:"))


def _names_a_device(node):
    if _is_device_word(node):
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
        _is_device_word(e) for e in node.elts)


def device_branches(path):
    """``(function, line)`` of each comparison with a device name in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Compare) and any(
                    _names_a_device(x) for x in [child.left, *child.comparators]):
                found.append((inner, child.lineno))
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr in ("startswith", "endswith")
                  and any(_names_a_device(a) for a in child.args)):
                found.append((inner, child.lineno))
            visit(child, inner)

    visit(tree, "")
    return found


def test_public_modules_do_not_branch_on_the_device():
    bad, used = [], set()
    for path in public_sources():
        for where, line in device_branches(path):
            key = (path.name, where.rpartition(".")[2] if where else "")
            if key in DEVICE_BRANCH_ALLOWED:
                used.add(key)
            else:
                bad.append(f"{path.relative_to(ROOT)}:{line} in {where or '<module>'}")
    assert not bad, ("public code branches on the device name (ask the backend instead, "
                     "or allow-list it with a reason):\n" + "\n".join(bad))
    assert used == set(DEVICE_BRANCH_ALLOWED), \
        f"allow-list entries that no longer branch: {set(DEVICE_BRANCH_ALLOWED) - used}"


@pytest.mark.parametrize("source, n", [
    ("x = 1 if self._backend.name != 'cpu' else 2", 1),
    ("if device == 'cuda':\n    pass", 1),
    ("ok = str(d).startswith('cuda')", 1),
    ("ok = d in ('cpu', 'cuda:0')", 1),
    ("ok = t.device.type == 'cuda'", 1),
    ("raise TypeError(\"device must be 'cpu' or 'cuda'\")", 0),
    ("x = get_backend(device)", 0),
    ("ok = kind == 'int8'", 0),
])
def test_the_device_branch_rule_can_fail(tmp_path, source, n):
    p = tmp_path / "m.py"
    p.write_text(f"def f(self, d, t, device, kind):\n" + "".join(
        f"    {line}\n" for line in source.splitlines()))
    assert len(device_branches(p)) == n


# The bookkeeping cores' members that a layer above reads are public-named
# (readonly fields and methods of SeqCore and PoolCore); an underscore member
# is the core's own.  A core is reached as X._seq (a PagedKVCache's SeqCore)
# or X._core (a BlockPool's PoolCore), made by SeqCore()/PoolCore()/bind(),
# or held in a name assigned from one of those.
_CORE_ATTRS = ("_seq", "_core")
_CORE_MAKERS = ("SeqCore", "PoolCore", "bind", "_sequence_core")


def core_private_reads(source):
    """``X._name`` reads (and calls) of underscore members of a SeqCore or
    PoolCore in ``source``, as ``"line: text"``."""
    tree = ast.parse(source)
    names = set()

    def is_core(node):
        if isinstance(node, ast.Attribute):
            return node.attr in _CORE_ATTRS
        if isinstance(node, ast.Name):
            return node.id in names
        if isinstance(node, ast.Call):
            f = node.func
            return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in _CORE_MAKERS
        return False

    def pairs(target, value):
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                yield from pairs(t, v)
        elif isinstance(target, ast.Name):
            yield target.id, value

    grew = True
    while grew:  # names assigned from a core (or from such a name)
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name, value in pairs(target, node.value):
                        if name not in names and is_core(value):
                            names.add(name)
                            grew = True
    lines = source.splitlines()
    found = {n.lineno for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr.startswith("_")
             and not n.attr.startswith("__") and n.attr not in _CORE_ATTRS and is_core(n.value)}
    return [f"{i}: {lines[i - 1].strip()}" for i in sorted(found)]


def test_no_layer_reads_an_underscore_member_of_a_core():
    """SeqCore and PoolCore offer the public classes public-named readonly
    fields and methods (docs/architecture.md, "Names"); nothing outside
    kvcore/_native reads one of their underscore members."""
    outside = [p for p in sources() if p.suffix == ".py" and layer_of(module_name(p)) != "native"]
    assert any(p.name == "paged.py" for p in outside)
    assert_none_offend(outside, core_private_reads,
                       "underscore members of a core read from outside it")


@pytest.mark.parametrize("source, bad", [
    ("n = self._seq._num_tokens", True),
    ("self._core._check()", True),
    ("seq = self._seq\nx = seq._table[:4]", True),
    ("a, core = 1, pool._core\ncore._evict()", True),
    ("s = SeqCore()\ns._fork_into(t)", True),
    ("s = _native_seq.bind(b, None, None, 0, 0, -1)\nprint(s._salt)", True),
    ("n = self._seq.num_tokens", False),
    ("self._core.check()", False),
    ("x = seq._max_written()", False),          # a PagedKVCache's own member
    ("s = SeqCore()\ns.__class__", False),
])
def test_the_core_reach_rule_can_fail(source, bad):
    assert bool(core_private_reads(source)) is bad


def test_the_leaf_modules_every_layer_may_import_import_no_kvcore_module():
    # kvcore._errors and kvcore._ints (argument checks, how a message shows
    # a value) sit below every layer: they may reach nothing of kvcore
    for leaf in ("_errors.py", "_ints.py"):
        assert imports(PKG / leaf) == set(), leaf
