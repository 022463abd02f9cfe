"""Deterministic removal of MediaWiki markup, leaving the prose of an article.

Not a MediaWiki renderer: templates (infoboxes, citations, ...) are dropped rather than
expanded, because what we need is natural running text for calibration and perplexity.
The wikitext is parsed by ``mwparserfromhell``; what stays here is the policy of what to keep:

1. the parse tree is rendered node by node: comments, templates, template arguments, tables
   and content-bearing tags (``<ref>``, ``<math>``, ``<gallery>``...) are dropped;
   ``[[File:..]]``/``[[Image:..]]``/``[[Category:..]]``/``[[Media:..]]`` and interlanguage links
   are dropped with their captions; ``[[a|b]]`` → ``b``; ``[[a]]`` → ``a``;
   ``[http://x label]`` → ``label``; bare URLs dropped; other html tags → their content;
   html entities → characters; headings stay ``== X ==`` lines for pass 3
2. ``'''`` / ``''`` marks and magic words (``__NOTOC__``) removed from the rendered text
3. per line (:func:`prose_lines`): ``== X ==`` → ``X`` (a heading is kept only if its section
   keeps some text; back-matter sections such as References / External links are dropped), list
   and indent marks removed, whitespace collapsed, lines with fewer than ``min_words`` words dropped.

Bold/italic marks are not parsed (``skip_style_tags``): MediaWiki closes an unbalanced ``''`` at
the end of the line, mwparserfromhell does not, and one such mark inside a ``<ref>`` or a table
cell makes it give up on that element (left as raw markup) or stretch it over the sections that
follow (prose lost). Pass 2 removes the quote runs as text instead.
"""

from __future__ import annotations

import re

import mwparserfromhell
from mwparserfromhell.nodes import Argument, Comment, ExternalLink, Heading, HTMLEntity, Node, Tag, Template, Text, Wikilink
from mwparserfromhell.wikicode import Wikicode

__all__ = ["clean_wikitext", "strip_markup", "prose_lines", "BACK_MATTER_SECTIONS", "DROPPED_ELEMENTS"]

# Tags whose content is not prose: dropped together with the content.
DROPPED_ELEMENTS = frozenset({"ref", "math", "gallery", "timeline", "score", "syntaxhighlight", "source", "pre",
                              "imagemap", "chem", "hiero", "graph", "mapframe", "templatedata", "references"})
# List, definition and rule tags keep their wiki mark; prose_lines removes it with the line's indent.
_LINE_MARK_TAGS = frozenset({"li", "dt", "dd", "hr"})
_TABLE_MARK = "{|"
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$")
_LIST_MARKS = re.compile(r"^[*#:;]+\s*")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_SPACES = re.compile(r"[ \t\u00a0\u2009\u200b]+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r" +([,.;:!?)])")
_EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
# Link namespaces whose targets are not visible text.
_HIDDEN_LINK_NAMESPACES = frozenset({"file", "image", "category", "media"})
_INTERLANGUAGE_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)*$")
BACK_MATTER_SECTIONS = frozenset({"references", "notes", "footnotes", "citations", "sources", "bibliography",
                                  "further reading", "external links", "see also", "notes and references"})
DEFAULT_MIN_WORDS = 4


def _render(code: Wikicode) -> str:
    return "".join(_render_node(node) for node in code.nodes)


def _render_link(link: Wikilink) -> str:
    target = str(link.title).strip()
    label = _render(link.text) if link.text is not None else ""
    if target.startswith(":"):  # [[:Category:X]] is a visible link to the category page
        return label or target[1:]
    namespace, has_namespace, _ = target.partition(":")
    namespace = namespace.strip()
    if has_namespace and namespace.lower() in _HIDDEN_LINK_NAMESPACES:
        return ""
    if has_namespace and link.text is None and _INTERLANGUAGE_PREFIX.match(namespace):
        return ""  # [[de:Anarchismus]]: a link to another language edition
    return label or _render(link.title)


def _render_tag(tag: Tag) -> str:
    name = str(tag.tag).strip().lower()
    if name in DROPPED_ELEMENTS:
        return ""
    if tag.wiki_markup == _TABLE_MARK:
        return " "  # a space, so that the words on both sides do not fuse
    if tag.wiki_markup and name in _LINE_MARK_TAGS:
        return tag.wiki_markup
    return _render(tag.contents) if tag.contents is not None else ""


def _render_node(node: Node) -> str:
    if isinstance(node, Text):
        return node.value
    if isinstance(node, (Template, Argument)):
        return " "  # "computers{{snd}}following" must not become one word; spaces are collapsed later
    if isinstance(node, Comment):
        return ""
    if isinstance(node, HTMLEntity):
        return node.normalize()
    if isinstance(node, Heading):
        return "=" * node.level + _render(node.title) + "=" * node.level
    if isinstance(node, Wikilink):
        return _render_link(node)
    if isinstance(node, ExternalLink):
        return _render(node.title) if node.brackets and node.title is not None else ""
    if isinstance(node, Tag):
        return _render_tag(node)
    return str(node)


def strip_markup(text: str) -> str:
    """Passes 1 and 2: the article's text without markup, line structure and ``== X ==`` headings kept."""
    rendered = _render(mwparserfromhell.parse(text, skip_style_tags=True))
    return _EMPHASIS.sub("", _MAGIC_WORD.sub("", rendered))


def _normalize_line(line: str) -> str:
    line = _SPACES.sub(" ", line).strip()
    line = _EMPTY_PARENS.sub("", line)  # "(  )" left where a template or ref used to be
    line = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", line)
    return _SPACES.sub(" ", line).strip()


def prose_lines(text: str, min_words: int = DEFAULT_MIN_WORDS) -> str:
    """Pass 3 on markup-free text: one paragraph (or kept heading) per line, in source order."""
    lines_out: list[str] = []
    pending_heading: str | None = None
    in_back_matter = False
    for raw_line in text.splitlines():
        heading = _HEADING.match(raw_line.strip())
        if heading:
            title = _normalize_line(heading.group(2))
            in_back_matter = title.lower() in BACK_MATTER_SECTIONS
            pending_heading = title if title and not in_back_matter else None
            continue
        stripped = raw_line.strip()
        # Table rows/cells outside a parsed table, and horizontal rules, are not prose.
        if in_back_matter or stripped.startswith(("|", "!", "----", "{|", "|}")):
            continue
        line = _normalize_line(_LIST_MARKS.sub("", stripped))
        if len(line.split()) < min_words:
            continue
        if pending_heading is not None:  # a heading is kept only above text that survived
            lines_out.append(pending_heading)
            pending_heading = None
        lines_out.append(line)
    return "\n".join(lines_out)


def clean_wikitext(text: str, min_words: int = DEFAULT_MIN_WORDS) -> str:
    """Plain prose of one article: one paragraph (or kept heading) per line, in source order.

    ``min_words``: body lines with fewer words are dropped (residue such as "thumb|" or lone links).
    """
    return prose_lines(strip_markup(text), min_words)
