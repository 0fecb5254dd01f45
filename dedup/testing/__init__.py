"""Throwaway servers for tests, ``dedup bench`` and the load tests: redis-server and
PostgreSQL processes (:mod:`.servers`) and a Redis Cluster (:mod:`.cluster`) on 127.0.0.1.

Nothing in the gateway imports this package.
"""
