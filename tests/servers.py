"""The tests' real servers live in :mod:`dedup.testing.servers` and :mod:`dedup.testing.cluster`
(``dedup bench`` starts them too)."""

from dedup.testing.cluster import RedisClusterServers
from dedup.testing.servers import *  # noqa: F403
from dedup.testing.servers import __all__ as _servers

__all__ = [*_servers, "RedisClusterServers"]
