r"""Griffe extension for the API reference: the reST bits of our Google-style docstrings, in Markdown.

The docstrings write maths as reST (``:math:`x```, ``.. math::`` blocks) and name code with reST roles
(``:func:`step```). mkdocstrings renders Markdown, so before a docstring is parsed this extension rewrites

* ``:math:`x``` to ``$x$`` and a ``.. math::`` block to a ``$$ ... $$`` block, which pymdownx.arithmatex hands to
  MathJax (a block with ``&`` or ``\\`` is wrapped in an ``aligned`` environment, as Sphinx does);
* a section headed ``Example:`` (Napoleon's spelling, which griffe reads as an admonition) to ``Examples:``,
  so that its ``>>>`` lines render as code;
* ``:class:`~a.b.C``` (and ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``) to the code span
  ```C``` — not a cross-reference, so that a role naming a private helper cannot break the strict build.

The source files are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_CODE_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_EXAMPLE_HEADING = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
_MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<inline>\S.*)?$")


def _code_role(match: re.Match) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


def _math_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_DIRECTIVE.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body = [match.group("inline")] if match.group("inline") else []
        i += 1
        # The directive's content: blank lines and lines indented deeper than the directive.
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        while body and not body[0]:
            body.pop(0)
        formula = "\n".join(indent + line for line in body if line)
        if "&" in formula or "\\\\" in formula:
            formula = f"{indent}\\begin{{aligned}}\n{formula}\n{indent}\\end{{aligned}}"
        out.extend(["", f"{indent}$$", formula, f"{indent}$$", ""])
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    """Rewrite the reST maths and code roles of one docstring (see the module docstring)."""
    text = _EXAMPLE_HEADING.sub(r"\1Examples:", text)
    text = _math_blocks(text)
    text = _MATH_ROLE.sub(lambda m: f"${m.group(1).strip()}$", text)
    return _CODE_ROLE.sub(_code_role, text)


class RstRoles(Extension):
    """Rewrite each docstring as it is loaded, before mkdocstrings parses its Google-style sections."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
