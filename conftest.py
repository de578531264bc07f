"""Collection rules for the docstring examples (``--doctest-modules`` over the packages).

The PyKEEN integration's modules import PyKEEN, an optional extra (``pip install
"dsa-core[pykeen]"``; ``make test`` installs it): without it they are not collected, as
``tests/adapters/pykeen/test_pykeen.py`` skips itself.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("pykeen") else ["adapters/*pykeen*.py"]
