"""Where the tests find the repository, whatever folder under tests/ they sit in (tests/<package>/ mirrors
gnetmdk/<package>/; tests/scripts/ holds the tools' and benchmarks' tests)."""
import os

#: the tests/ folder
TESTS = os.path.dirname(os.path.abspath(__file__))
#: the repository root (the working directory of the tools and training scripts the tests run)
REPO = os.path.dirname(TESTS)


def load_tool(name: str):
    """tools/<name>.py imported as a module (its ``main(argv)`` then runs in the test's process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
