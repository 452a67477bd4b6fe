"""Where the tests find the repository, whatever folder under tests/ they sit in (tests/<package>/ mirrors
gnetmdk/<package>/; tests/scripts/ holds the tools' and benchmarks' tests)."""
import os

#: the tests/ folder
TESTS = os.path.dirname(os.path.abspath(__file__))
#: the repository root (the working directory of the tools and training scripts the tests run)
REPO = os.path.dirname(TESTS)
