"""The engine: the steps of one save, a module each, wired once per open Gateway.

1. :mod:`.local` -- the local tier, values known saved in this process;
2. :mod:`.flights` -- singleflight, values in flight in this process;
3. :mod:`.batcher` and :mod:`.claim_stage` -- claims of one event-loop tick in one script
   call; :mod:`.wait_queue` -- values whose lease another writer holds;
4. :mod:`.write_stage` -- the winners in one statement, or, across processes,
   :mod:`.shared` (one elected writer; its wire format in :mod:`.shared_wire`);
5. :mod:`.write_stage` -- one script call commits the batch.

Beside the path: :mod:`.degraded` and :mod:`.breaker` (Redis down), :mod:`.backends` (the
servers a Gateway opens), :mod:`.wiring` (the stages built in order), :mod:`.parts` (what
code beside the hot path may use) and :mod:`.once` (run-once functions, ``get``, ``filter``).
"""
