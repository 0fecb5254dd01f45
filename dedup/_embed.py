"""Run-once functions, the saved-payload read path and stream filtering (in progress)."""

from __future__ import annotations

__all__: list[str] = []
