"""The tests' real servers live in :mod:`dedup.servers` (``dedup bench`` starts them too)."""

from dedup.servers import *  # noqa: F403
from dedup.servers import __all__ as __all__
