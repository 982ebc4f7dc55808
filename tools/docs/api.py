"""The Python API page (mkdocstrings directives, one section per public name) and the
audit of its docstrings: what users import is taken from the ``__all__`` of the modules
below, so a new export cannot be left out of the page."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from tools.docs.markdown import page

# The modules users import from: each one's whole ``__all__`` is documented.
PUBLIC_MODULES = (
    "kafka_idem",
    "kafka_idem.codecs",
    "kafka_idem.codecs.protobuf",  # ProtobufCodec (the protobuf extra)
    "kafka_idem.console",  # create_app, Options (the console extra)
    "kafka_idem.testing",
    "kafka_idem.verify",
)
# Single names of a module that is not public as a whole (its ``__all__`` is internal).
PUBLIC_NAMES = (
    "kafka_idem.settings.load_settings",
)


def exported(module: str) -> list[str]:
    """``module``'s ``__all__``, sorted without regard to case; dunder names
    (``__version__``) are said in the page's introduction instead."""
    names = getattr(importlib.import_module(module), "__all__", None)
    if names is None:
        raise ValueError(f"{module} has no __all__")
    return sorted((n for n in names if not n.startswith("__")), key=lambda n: (n.lower(), n))


def sections() -> list[tuple[str, list[str]]]:
    """``(module, the qualified names documented under it)``, in page order."""
    out = [(m, [f"{m}.{n}" for n in exported(m)]) for m in PUBLIC_MODULES]
    singles: dict[str, list[str]] = {}
    for qualified in PUBLIC_NAMES:
        singles.setdefault(qualified.rpartition(".")[0], []).append(qualified)
    out += [(m, sorted(names)) for m, names in sorted(singles.items())]
    return out


def public_names() -> list[str]:
    """Every qualified name the API page documents."""
    return [name for _, names in sections() for name in names]


def resolve(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def api_page() -> str:
    body = [
        "The Python API: every name of the modules users import from, with its "
        "docstring. Import them from the module they are listed under "
        "(`from kafka_idem import App`, `from kafka_idem.testing import Harness`). "
        "`kafka_idem.__version__` is the installed version (`kafka-idem --version`).",
        "",
    ]
    for module, names in sections():
        body += [f"## {module}", ""]
        if module in PUBLIC_MODULES:
            body += [f"::: {module}", "    options:", "      show_root_heading: false",
                     "      members: false", ""]
        for name in names:
            body += [f"::: {name}", "    options:", "      show_root_heading: true",
                     "      heading_level: 3", ""]
    return page("Python API", "the __all__ of " + ", ".join(PUBLIC_MODULES)
                + " and " + ", ".join(PUBLIC_NAMES), body)


# --- the docstring audit ----------------------------------------------------------------

def _has_text(doc: object) -> bool:
    return isinstance(doc, str) and bool(doc.strip())


def _own_class_doc(cls: type) -> bool:
    """A docstring written for the class itself, not one made up for it (a dataclass's
    signature, an Enum's or a NamedTuple's boilerplate)."""
    doc = cls.__dict__.get("__doc__")
    if not _has_text(doc):
        return False
    assert isinstance(doc, str)
    made_up = doc.startswith(f"{cls.__name__}(") or doc in ("An enumeration.",)
    return not made_up


def _member_doc(member: Any) -> bool | None:
    """Whether a class member has a docstring; ``None`` for a member that is no
    method or property (a field, a constant)."""
    if isinstance(member, staticmethod | classmethod):
        member = member.__func__
    if isinstance(member, property):
        return _has_text(member.fget.__doc__ if member.fget else None)
    if isinstance(member, functools.cached_property):
        return _has_text(member.func.__doc__)
    if inspect.isfunction(member):
        return _has_text(member.__doc__)
    return None


def _attribute_doc(module: str, name: str) -> bool:
    """Whether ``name``, a constant, has an attribute docstring (a string right after
    its assignment) in the module that assigns it, following ``from X import name``."""
    path = Path(inspect.getfile(sys.modules[module]))
    tree = ast.parse(path.read_text())
    body = tree.body
    for i, node in enumerate(body):
        if isinstance(node, ast.ImportFrom) and node.module and any(
                (a.asname or a.name) == name for a in node.names):
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            importlib.import_module(node.module)
            return _attribute_doc(node.module, original)
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            after = body[i + 1] if i + 1 < len(body) else None
            return (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and _has_text(after.value.value))
    return False


def undocumented(names: list[str] | None = None) -> list[str]:
    """Every public name of the API page (or of ``names``) without a docstring, and every
    public method or property of its classes without one (members defined in the class
    itself: the ones its section shows)."""
    missing = []
    for qualified in public_names() if names is None else names:
        obj = resolve(qualified)
        if inspect.isclass(obj):
            if not _own_class_doc(obj):
                missing.append(qualified)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if _member_doc(member) is False:
                    missing.append(f"{qualified}.{attr}")
        elif callable(obj):
            if not _has_text(obj.__doc__):
                missing.append(qualified)
        elif not _attribute_doc(qualified.rpartition(".")[0], qualified.rpartition(".")[2]):
            missing.append(qualified)
    return missing
