"""Reaching Redis: connections and server checks (:mod:`.connect`, :mod:`.server`), the
script runner and its per-version variants (:mod:`.script`), the fast argument packing
(:mod:`.packing`) and the embedded redis-server (:mod:`.embedded`).
"""
