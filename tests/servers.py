"""The tests' real servers live in :mod:`dedup.servers` and :mod:`dedup.cluster_servers`
(``dedup bench`` starts them too)."""

from dedup.cluster_servers import RedisClusterServers
from dedup.servers import *  # noqa: F403
from dedup.servers import __all__ as _servers

__all__ = [*_servers, "RedisClusterServers"]
