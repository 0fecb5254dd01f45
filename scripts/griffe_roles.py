"""A griffe extension for the API reference (mkdocs.yml): Sphinx roles to Markdown code.

The docstrings cross-reference with reST roles (``:class:`~dedup.Gateway```), which
Markdown would show as they are. This turns each into inline code of its target, the last
dotted part only when the target starts with ``~``, as Sphinx shows it.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    target = match.group(2).strip()
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` in every docstring to `` `target` ``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called once per loaded object (module, class, function, attribute)."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
