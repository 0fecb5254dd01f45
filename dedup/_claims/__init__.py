"""The Redis claim protocol: one script call decides a batch (:mod:`.protocol`), its Lua
(:mod:`.scripts`), key names and the compact marker layout (:mod:`.keys`), and the
approximate mode's Bloom filter (:mod:`.bloom`).
"""
