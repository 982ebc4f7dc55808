"""A griffe extension for the API page: kafka_idem's docstrings are written with reST
roles (``:class:`~kafka_idem.x.Y```, ``:meth:`stop```) and ``::`` before a literal
block; mkdocstrings reads Markdown. Each role becomes a cross-reference when its target
is on the site (else plain code, no warning), and a trailing ``::`` a colon.

In mkdocs.yml, under the python handler's options::

    extensions:
      - tools/docs/griffe_rest.py:RestRoles
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([\w.]+)(\(\))?`")
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)  # "from code::" -> "from code:"
_LONE_LITERAL = re.compile(r"^[ \t]*::[ \t]*$", re.MULTILINE)  # a line of "::" alone


def _target(obj: griffe.Object, name: str) -> str:
    """``name`` as a full path, resolved in ``obj``'s scope where it is not one."""
    if name.startswith("kafka_idem."):
        return name
    first, _, rest = name.partition(".")
    for scope in (obj, obj.parent):
        if scope is None:
            continue
        try:
            found = scope.resolve(first)
        except Exception:  # griffe.NameResolutionError, or an alias it cannot follow
            continue
        return f"{found}.{rest}" if rest else found
    return name


def rewrite(obj: griffe.Object, text: str) -> str:
    """``text`` with its roles as optional cross-references and ``::`` as ``:``."""

    def role(found: re.Match[str]) -> str:
        short, name, call = found.group(1), found.group(2), found.group(3) or ""
        shown = (name.rpartition(".")[2] if short else name) + call
        return (f'<autoref identifier="{_target(obj, name)}" optional>'
                f"<code>{shown}</code></autoref>")

    text = _ROLE.sub(role, text)
    text = _LONE_LITERAL.sub("", text)
    return _LITERAL.sub(r"\1:", text)


class RestRoles(griffe.Extension):
    """Rewrites every docstring of the loaded objects (:func:`rewrite`)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Once the object tree is complete, so that names resolve."""
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj, obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """The top package's own docstring (not given to :meth:`on_object`)."""
        self.on_object(obj=pkg)
