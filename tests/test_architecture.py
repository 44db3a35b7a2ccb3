"""The package's structure (issue #29): where tables are filled, the module import graph, layer walls."""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import expecttest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "affineq"

_TABLES = r"""
import torch
import affineq.tensor
from affineq.tensor.affine import AffineQuantizedTensor as A
from affineq.tensor.formats import FORMATS
from affineq.tensor.kernel_registry import LINEAR_KERNELS

def name(op):
    return str(op) if isinstance(op, torch._ops.OpOverload) else f"{op.__module__}.{op.__name__}"

for title, names in [("formats", sorted(FORMATS)), ("kernels, in the order tried", [k.name for k in LINEAR_KERNELS]),
                     ("torch functions", sorted(map(name, A._torch_function_table))),
                     ("aten ops", sorted(map(name, A._dispatch_table)))]:
    print(title + ":", *(f"\n  {n}" for n in names), sep="")
"""


def test_tensor_package_fills_every_table():
    """`import affineq.tensor` in a fresh process fills the format, kernel and op tables (tensor/__init__.py)."""
    out = subprocess.run([sys.executable, "-c", _TABLES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expecttest.assert_expected_inline(
        out.stdout,
        """\
formats:
  dense
  int4_cpu
  int4_cuda
  microexp
  plain
  q2_k
  q3_k
  q4_k
  q5_k
  q6_k
kernels, in the order tried:
  affineq.int8_codes_linear
  affineq.dequant_linear
  affineq.lowbit_linear
  affineq.kquant_linear
  aten._weight_int4pack_mm_for_cpu
  aten._weight_int4pack_mm
  onednn.qlinear
  aten._int_mm
  onednn.qlinear:static
  aten._int_mm:static
  aten._weight_int8pack_mm
  aten._scaled_mm
torch functions:
  torch._C._nn.linear
  torch.nn.functional.embedding_bag
aten ops:
  _c10d_functional._wrap_tensor_autograd.default
  _c10d_functional.all_gather_into_tensor.default
  _c10d_functional.wait_tensor.default
  aten._to_copy.default
  aten._unsafe_view.default
  aten.addmm.default
  aten.alias.default
  aten.bmm.default
  aten.cat.default
  aten.clone.default
  aten.convolution.default
  aten.copy_.default
  aten.detach.default
  aten.embedding.default
  aten.embedding_dense_backward.default
  aten.empty_like.default
  aten.equal.default
  aten.expand.default
  aten.flatten.using_ints
  aten.index.Tensor
  aten.is_pinned.default
  aten.linear.default
  aten.matmul.default
  aten.mm.default
  aten.new_empty.default
  aten.permute.default
  aten.reshape.default
  aten.select.int
  aten.slice.Tensor
  aten.split.Tensor
  aten.split_with_sizes.default
  aten.squeeze.dim
  aten.t.default
  aten.transpose.int
  aten.unbind.int
  aten.unsqueeze.default
  aten.view.default
  c10d.broadcast_.default
  c10d.scatter_.default
""",
    )


def _sources():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_no_import_after_code():
    """Registration is never a side effect of an import at the bottom of a module: every module-level import
    comes before the module's first other statement (a docstring, TYPE_CHECKING blocks and `try: import` guards
    count as imports)."""
    late = []
    for path, tree in _sources():
        seen_code = False
        for node in tree.body:
            is_import = isinstance(node, ast.Import | ast.ImportFrom)
            if is_import and seen_code:
                late.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            seen_code |= not (is_import or docstring or _is_import_block(node))
    assert late == [], late


def _is_import_block(node) -> bool:
    """`if TYPE_CHECKING:` or `try:` around imports only."""
    if isinstance(node, ast.If):
        return "TYPE_CHECKING" in ast.unparse(node.test)
    return isinstance(node, ast.Try) and all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body)


# -- the module import graph ------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _imports():
    """[(importer, imported module, imported name or None, line)] for every `affineq` import in the package,
    module-level and inside functions alike (a function-level import still ties the two modules at run time);
    imports under `if TYPE_CHECKING:` are skipped."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    out = []
    for path, tree in _sources():
        me = _module_name(path)
        skip = {id(n) for node in ast.walk(tree) if _is_import_block(node) and isinstance(node, ast.If)
                for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [(f"{node.module}.{a.name}", None) if f"{node.module}.{a.name}" in modules
                         else (node.module, a.name) for a in node.names]
            else:
                continue
            for target, name in found:
                if target.split(".")[0] == "affineq":
                    while target not in modules:
                        target = target.rsplit(".", 1)[0]
                    out.append((me, target, name, node.lineno))
    return modules, out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                comps.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return comps


# Import cycles still allowed, each with its reason (remove the entry when the cycle is gone).
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}  # none today


def test_no_import_cycle():
    """No cycle in the import graph of `affineq` (function-level imports count; TYPE_CHECKING ones do not)."""
    _, imports = _imports()
    edges: dict[str, set[str]] = {}
    for me, target, _, _ in imports:
        if me != target:
            edges.setdefault(me, set()).add(target)
    cycles = [tuple(c) for c in _cycles(edges)]
    assert sorted(c for c in cycles if c not in ALLOWED_CYCLES) == []
    assert not set(ALLOWED_CYCLES) - set(cycles), "an allowed cycle is gone: remove it from ALLOWED_CYCLES"


WORKFLOWS = ("affineq.algorithms", "affineq.qat", "affineq.calibration", "affineq.graph", "affineq.streaming",
             "affineq.hf", "affineq.ao_compat", "affineq.quark_config")


def test_quantize_imports_no_workflow():
    """`quantize_` knows handlers and the planner only; workflows are configs that say how their steps run."""
    _, imports = _imports()
    used = sorted({t for me, t, _, _ in imports if me in ("affineq.quantize", "affineq.plan")})
    assert [t for t in used if t.startswith(WORKFLOWS)] == [], used


# Private names (a leading underscore in the module path or the name) that a module may still import from
# another package, each with its reason.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {}  # (importer, name) -> why; none today


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_from_another_package():
    """No module imports a private name (or from a private module) of another package; modules of one
    package (one directory) may share theirs."""
    modules, imports = _imports()
    found = set()
    for me, target, name, _ in imports:
        if target == me:
            continue
        mine = me if modules[me].name == "__init__.py" else me.rpartition(".")[0]
        theirs = target if modules[target].name == "__init__.py" else target.rpartition(".")[0]
        full = target if name is None else f"{target}.{name}"
        if theirs != mine and any(_is_private(part) for part in full.split(".")[1:]):
            found.add((me, full))
    assert sorted(found - set(ALLOWED_PRIVATE)) == []
    assert not set(ALLOWED_PRIVATE) - found, "an allowed private import is gone: remove it from ALLOWED_PRIVATE"


# -- the public API in tiers -----------------------------------------------------------------------------


def test_top_level_is_the_product_tier():
    import affineq

    assert len(affineq.__all__) <= 50 and len(set(affineq.__all__)) == len(affineq.__all__)
    for name in affineq.__all__:
        assert getattr(affineq, name) is not None, name
    assert not set(affineq.__all__) & set(affineq.MOVED)


def test_every_moved_name_still_imports_with_a_warning_naming_its_new_place():
    import importlib
    import warnings

    import affineq

    for name, where in affineq.MOVED.items():
        assert name not in vars(affineq), f"{name} is still a module global: it would never warn"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = getattr(affineq, name)
        assert [w.category for w in caught] == [DeprecationWarning], name
        assert f"{where}.{name}" in str(caught[0].message), str(caught[0].message)
        assert old is getattr(importlib.import_module(where), name)
        assert name in dir(affineq)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from affineq import PerTensor  # noqa: F401  (the `from` spelling goes through __getattr__ too)
    assert "affineq.granularity.PerTensor" in str(caught[0].message)


class _AnyKey(dict):
    def __missing__(self, key: str) -> str:
        return ""


def test_every_command_line_help_formats():
    """argparse expands each help string with `%` (so `--help` of a script whose help says "K % 256" raised
    ValueError): every literal help= in the package, the benchmarks and the tutorials must survive that."""
    bad = []
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tutorials").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            for kw in node.keywords:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    try:
                        kw.value.value % _AnyKey()
                    except (ValueError, TypeError) as e:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {e}")
    assert bad == [], bad


def test_every_affineq_name_the_scripts_import_exists():
    """Benchmarks and tutorials import affineq names inside functions too (bench_decode's llama.cpp row imported a
    helper renamed long before, and only that row, which CI cannot run, failed): each `from affineq... import x`
    in them names an attribute its module has."""
    import importlib

    missing = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tutorials").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "affineq":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert missing == [], missing
