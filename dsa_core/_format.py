"""TEMPORARY shim during the split of this module (removed before the submission)."""
from ._files import *  # noqa: F401,F403
from ._layout import *  # noqa: F401,F403
from ._layout import MAGIC  # noqa: F401
from ._paging import *  # noqa: F401,F403
from ._store import *  # noqa: F401,F403
