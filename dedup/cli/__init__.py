"""The ``dedup`` command (:mod:`.main`) and the commands that live nowhere else:
``demo`` (:mod:`.demo`) and ``check`` (:mod:`.check`).
"""

from __future__ import annotations

from dedup.cli.main import (
    build_parser,
    main,
)

__all__ = [
    "build_parser",
    "main",
]
