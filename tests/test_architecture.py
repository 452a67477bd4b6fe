"""The package's floors (docs/architecture.md, "Floors"), read from the source with ``ast``: every
module-level import points to the importer's floor or below; the only module-level circle is
gnetmdk.models and its two families; the imports inside functions that point up are exactly the ones
docs/architecture.md lists ("Imports that point up"), so a new one fails here until it is removed or
written down, and one removed must leave the list."""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "gnetmdk")

#: package (a prefix of the module name under gnetmdk) -> floor; the first matching prefix wins
FLOORS = (("utils", 1), ("config", 1), ("checkpoint", 2), ("dist", 2), ("align", 2), ("chip", 7),
          ("gti", 3), ("intq", 3), ("layers", 4), ("dataset", 4), ("evaluation", 5), ("models", 6), ("engine", 8))

#: the module-level circle allowed: gnetmdk.models imports its families, which import it to register themselves
#: (in gnetmdk.config.registry, a leaf)
REGISTRY = {"gnetmdk.models", "gnetmdk.models.gnetdet", "gnetmdk.models.ppyolo"}

#: (importing module, imported module) of every import inside a function that points up a floor
KNOWN_DEFERRED_UP = {
    ("gnetmdk.config.registry", "gnetmdk.models"),
}


def floor(module: str):
    rel = module[len("gnetmdk."):] if module.startswith("gnetmdk.") else ""
    for prefix, level in FLOORS:
        if rel == prefix or rel.startswith(prefix + "."):
            return level
    return None


def modules():
    """{module name: file path} of every .py file under gnetmdk/."""
    out = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports():
    """[(importer, imported module, line, module level?)] of every import of a gnetmdk module; ``from X
    import y`` counts as an import of X.y where that is a module, else of X."""
    mods = modules()
    found = []
    for name, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        top = {id(n) for n in tree.body}
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name and t != "gnetmdk":
                    found.append((name, t, node.lineno, id(node) in top))
    return found


def test_every_module_is_on_a_floor():
    unplaced = sorted(m for m in modules() if m != "gnetmdk" and floor(m) is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS and docs/architecture.md): {unplaced}"


def test_module_level_imports_point_down():
    up = [f"{a}:{line} imports {b} (floor {floor(a)} -> {floor(b)})"
          for a, b, line, top in imports() if top and floor(b) > floor(a)]
    assert not up, "module-level imports up a floor:\n" + "\n".join(up)


def test_no_module_level_circle_but_the_registry():
    graph = {}
    for a, b, _line, top in imports():
        if top:
            graph.setdefault(a, set()).add(b)
    circles = []
    index, low, stack, on = {}, {}, [], set()

    def strong(v):                     # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert [c for c in circles if c != REGISTRY] == [], circles
    assert REGISTRY in circles          # the registry circle is seen: the scan reads `from . import gnetdet`


def test_imports_inside_functions_that_point_up_are_the_listed_ones():
    up = {(a, b) for a, b, _line, top in imports() if not top and floor(b) > floor(a)}
    new, gone = sorted(up - KNOWN_DEFERRED_UP), sorted(KNOWN_DEFERRED_UP - up)
    assert not new, f"new imports up a floor inside functions (remove, or list in docs/architecture.md): {new}"
    assert not gone, f"listed imports up a floor no longer there (take them off the list and the doc): {gone}"


@pytest.mark.parametrize("module", ["gnetmdk.align.record", "gnetmdk.align.compare", "gnetmdk.align.options"])
def test_align_imports_nothing_of_the_engine(module):
    """The record format and the comparisons sit below the trainer that drives them."""
    assert not [b for a, b, _l, _t in imports() if a == module and b.startswith("gnetmdk.engine")]


def test_every_module_is_imported_by_a_test():
    """Each module of the package is imported by name by at least one test file (not only reached
    through a subprocess), so a unit test can fail on it."""
    mods = set(modules()) - {"gnetmdk"}
    seen = set()
    here = os.path.dirname(os.path.abspath(__file__))
    for dirpath, _dirs, files in os.walk(here):
        for f in files:
            if not f.endswith(".py"):
                continue
            with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gnetmdk"):
                    seen.add(node.module)
                    seen.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    seen.update(a.name for a in node.names if a.name.startswith("gnetmdk"))
    untested = sorted(m for m in mods if m not in seen and not any(s.startswith(m + ".") for s in seen))
    assert not untested, f"modules no test imports: {untested}"


def test_family_blocks_are_the_layer_units_the_conversions_recognise():
    """The in-place activated BatchNorm and recomputed-stem conversions find the families' conv ->
    BatchNorm -> activation blocks through gnetmdk.layers.units, not by their model classes."""
    from gnetmdk.layers.units import ConvBNAct, ConvBNQReLU, ConvBNUnit
    from gnetmdk.models.gnetdet.model import Sublayer
    from gnetmdk.models.ppyolo.common import ConvBNLayer
    assert issubclass(Sublayer, ConvBNQReLU) and issubclass(ConvBNLayer, ConvBNAct)
    assert issubclass(ConvBNQReLU, ConvBNUnit) and issubclass(ConvBNAct, ConvBNUnit)
    assert not issubclass(ConvBNLayer, ConvBNQReLU) and not issubclass(Sublayer, ConvBNAct)


def test_the_config_loads_no_family_until_a_lookup():
    """gnetmdk.config, gnetmdk.checkpoint.io and gnetmdk.dataset.dataset import no family: the registry
    (gnetmdk.config.registry) imports gnetmdk.models on the first lookup that needs it."""
    import subprocess
    import sys
    code = ("import sys\n"
            "import gnetmdk.config, gnetmdk.config.registry, gnetmdk.checkpoint.io, gnetmdk.dataset.dataset\n"
            "assert not any(m.startswith('gnetmdk.models') for m in sys.modules), sorted(sys.modules)\n"
            "from gnetmdk.config.registry import get_family, sections\n"
            "assert get_family('ppyolo').name == 'ppyolo' and set(sections()) >= {'gnetdet', 'ppyolo'}\n"
            "import gnetmdk.models\n"
            "assert gnetmdk.models.get_family is get_family and gnetmdk.models.FAMILIES['gnetdet'].name == 'gnetdet'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_registry_refuses_an_unknown_model_with_the_closest_names():
    """A name no family or builder has: ConfigError naming the closest names and every registered one."""
    from gnetmdk.config.base import ConfigError
    from gnetmdk.config.registry import get_family
    with pytest.raises(ConfigError, match=r"unknown model 'gnetdt'; did you mean gnetdet.*\(registered: .*ppyolo"):
        get_family("gnetdt")


def test_engine_modules_re_export_the_lower_ones():
    """The stage table, the cap calibration and the device choice sit below the chip model; the engine's
    modules of the same names hand on the same objects."""
    from gnetmdk.dist import device as low_device
    from gnetmdk.engine import calibration, device, stages
    from gnetmdk.models import calibration as low_calibration
    from gnetmdk.models import stages as low_stages
    assert stages.STAGES is low_stages.STAGES and stages.apply_stage is low_stages.apply_stage
    assert calibration.calibrate_caps is low_calibration.calibrate_caps
    assert device.set_tf32 is low_device.set_tf32 and device.resolve_device is low_device.resolve_device
