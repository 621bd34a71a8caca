"""A griffe extension, for the API reference only: shows the docstrings' reStructuredText idioms as Markdown.

The docstrings are Google style as Sphinx's napoleon reads them, so they use Sphinx roles (``:class:`Trainer```) and
literal blocks (``Example::`` and an indented block) and links (```timm <https://timm.fast.ai>`_``). mkdocstrings
renders docstrings as Markdown, where a role would show as ``:class:Trainer`` and a literal block lose its
``Example`` heading. Once the package is loaded, this turns each role into a link to the object's entry in the
reference (plain code when the object has none), each literal block into a fenced block (under an ``Example``
section when it is one) and each link into a Markdown link. Only the copy mkdocstrings renders changes:
the source, ``help()`` and Sphinx see the docstrings as written. The line numbers of griffe's warnings may be off by
one after a literal block.

Loaded from mkdocs.yml (``extensions``); mkdocs does not copy it into the site (``exclude_docs``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`Trainer`, :meth:`~pytorch_accel_trainer.trainer.Trainer.train`, :py:func:`x` ...
_ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|func|attr|data|const|mod|obj|exc):`(?P<tilde>~?)(?P<target>[^`<>]+)`")
# `timm's schedulers <https://timm.fast.ai/schedulers>`_
_LINK = re.compile(r"`(?P<text>[^`<]+?)\s*<(?P<url>[a-z]+://[^>]+)>`__?")
_EXAMPLE_HEADINGS = ("Example", "Examples")


class SphinxMarkupToMarkdown(griffe.Extension):
    """Rewrites the docstrings of every object of a package once the whole package is loaded (so names resolve)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        objects = list(_objects(pkg))
        paths_by_name: dict = {}
        for obj in objects:
            paths_by_name.setdefault(obj.name, set()).add(obj.path)
        unique_paths = {name: paths.pop() for name, paths in paths_by_name.items() if len(paths) == 1}
        for obj in objects:
            if obj.docstring is not None:
                text = _LINK.sub(r"[\g<text>](\g<url>)", obj.docstring.value)
                text = roles_to_links(text, obj, unique_paths)
                obj.docstring.value = literal_blocks_to_fences(text)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def roles_to_links(text: str, scope: griffe.Object, unique_paths: dict) -> str:
    """Replace each Sphinx role with an optional cross-reference: a link where the target is in the reference."""

    def link(match: re.Match) -> str:
        target = match["target"].strip()
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        if match["role"] in ("meth", "func"):
            shown += "()"
        return f'<autoref identifier="{_resolve(target, scope, unique_paths)}" optional>`{shown}`</autoref>'

    return _ROLE.sub(link, text)


def _resolve(target: str, scope: griffe.Object, unique_paths: dict) -> str:
    """The full path of ``target`` as written in ``scope``: a name in scope (``Trainer.train`` included), else the
    one object of the package with that name (a mixin's docstring naming a method of another mixin), else as is."""
    first, _, rest = target.partition(".")
    try:
        path = scope.resolve(first)
    except (griffe.NameResolutionError, AttributeError):
        path = unique_paths.get(first)
        if path is None:
            return target
    return f"{path}.{rest}" if rest else path


def literal_blocks_to_fences(text: str) -> str:
    """Turn each ``text::`` paragraph and the indented block after it into ``text:`` and a fenced block.

    ``Example::`` becomes a Google ``Example:`` section holding a fenced Python block.
    """
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        start = _literal_block_start(lines, i)
        if start is None:
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        end = start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        block = lines[start:end]
        while block and not block[-1].strip():
            block.pop()
        heading = line.rstrip()[:-1]  # "Example::" -> "Example:"
        is_section = heading.strip()[:-1] in _EXAMPLE_HEADINGS
        fence_indent = " " * (indent + 4) if is_section else " " * indent
        out.append(heading)
        if not is_section:
            out.append("")
        out.append(fence_indent + ("```python" if is_section else "```"))
        block_indent = min(_indent(b) for b in block if b.strip())
        out.extend(fence_indent + b[block_indent:] if b.strip() else "" for b in block)
        out.append(fence_indent + "```")
        if end < len(lines):
            out.append("")
        i = end
    return "\n".join(out)


def _literal_block_start(lines: list, i: int):
    """The index of the first line of the indented block that ``lines[i]`` (ending in ``::``) introduces, or None."""
    line = lines[i]
    if not line.rstrip().endswith("::") or line.strip() == "::":
        return None
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j == i + 1 or j >= len(lines) or _indent(lines[j]) <= _indent(line):
        return None
    return j


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))
