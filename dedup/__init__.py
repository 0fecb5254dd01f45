"""dedup: save each value of a kind exactly once, with Redis in front of the database.

The public names: :class:`Gateway`, its blocking form :class:`SyncGateway`,
:class:`SaveResult`, :class:`Stats`, the error tree under :class:`DedupError`,
and the sink types :class:`Row` and :data:`BatchWriter`. The lock library lives
in :mod:`dedup.lock`.
"""

from dedup.errors import (
    CannotForget,
    ConfigError,
    DedupError,
    InvalidInput,
    Overloaded,
    Unavailable,
    WaitTimeout,
)
from dedup.gateway import Gateway
from dedup.metrics import Stats
from dedup.sync import SyncGateway
from dedup.types import BatchWriter, Item, Reconciled, Row, SaveResult, Source

__all__ = [
    "BatchWriter",
    "CannotForget",
    "ConfigError",
    "DedupError",
    "Gateway",
    "InvalidInput",
    "Item",
    "Overloaded",
    "Reconciled",
    "Row",
    "SaveResult",
    "Source",
    "Stats",
    "SyncGateway",
    "Unavailable",
    "WaitTimeout",
]

__version__ = "0.1.0"

# Reprs, tracebacks and the docs name the public classes where users import them from
# (``dedup.Gateway``), not the module that happens to define them.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj
