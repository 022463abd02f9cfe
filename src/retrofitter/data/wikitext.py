"""Deterministic removal of MediaWiki markup, leaving the prose of an article.

Not a MediaWiki renderer: templates (infoboxes, citations, ...) are dropped rather than
expanded, because what we need is natural running text for calibration and perplexity.
Passes, in order (each one is a pure function of the text):

1. comments ``<!-- -->`` and content-bearing tags (``<ref>``, ``<math>``, ``<gallery>``...)
2. templates ``{{...}}`` (nested, by bracket matching) and tables ``{| ... |}``
3. links (bracket counting): ``[[File:..]]``/``[[Image:..]]``/``[[Category:..]]`` (and interlanguage links) dropped
   with any links nested in their captions; ``[[a|b]]`` → ``b``; ``[[a]]`` → ``a``
4. external links ``[http://x label]`` → ``label``; remaining html tags; ``'''`` / ``''`` marks;
   html entities
5. per line: ``== X ==`` → ``X`` (a heading is kept only if its section keeps some text;
   back-matter sections such as References / External links are dropped), list and indent
   marks removed, whitespace collapsed, lines with fewer than ``min_words`` words dropped.
"""

from __future__ import annotations

import html
import re

__all__ = ["clean_wikitext", "remove_nested", "remove_hidden_links", "replace_links", "BACK_MATTER_SECTIONS"]

# Tags whose content is not prose: dropped together with the content.
_DROPPED_ELEMENTS = ("ref", "math", "gallery", "timeline", "score", "syntaxhighlight", "source", "pre",
                     "imagemap", "chem", "hiero", "graph", "mapframe", "templatedata", "references")
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.DOTALL)
_SELF_CLOSING = re.compile(r"<(?:%s)\b[^<>]*/>" % "|".join(_DROPPED_ELEMENTS), re.IGNORECASE)
_ELEMENT_PATTERNS = [re.compile(rf"<{name}\b[^<>]*>.*?</{name}\s*>", re.IGNORECASE | re.DOTALL)
                     for name in _DROPPED_ELEMENTS]
_HTML_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*>")
_TEMPLATE_TOKENS = re.compile(r"\{\{|\}\}")
_TABLE_TOKENS = re.compile(r"^[ \t]*\{\||^[ \t]*\|\}", re.MULTILINE)
_LINK_TOKENS = re.compile(r"\[\[|\]\]")
_HIDDEN_LINK_START = re.compile(r"\s*(?:file|image|category|media)\s*:", re.IGNORECASE)
_INNERMOST_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:(?:https?|ftp):)?//[^\s\[\]]+(?:\s+([^\[\]]*))?\]")
_BARE_URL = re.compile(r"\bhttps?://\S+")
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


def remove_nested(text: str, tokens: re.Pattern, opener_first_char: str, replacement: str = " ") -> str:
    """Replace every span between matched opening and closing tokens (nesting included) by ``replacement``.

    ``tokens`` matches both the opener and the closer; a match whose text (after leading
    whitespace) starts with ``opener_first_char`` opens a span. Spans are matched with a stack;
    the union of all matched spans is removed, so an unclosed outer opener keeps its text
    but its properly closed inner spans are still removed. Unmatched closers are kept.
    The default replacement is a space so that words on both sides do not fuse
    ("computers{{snd}}following"); spaces are collapsed later.
    """
    stack: list[int] = []
    spans: list[tuple[int, int]] = []
    for match in tokens.finditer(text):
        if match.group().lstrip().startswith(opener_first_char):
            stack.append(match.start())
        elif stack:
            spans.append((stack.pop(), match.end()))
    if not spans:
        return text
    pieces, cursor = [], 0
    for start, end in sorted(spans):
        if end <= cursor:  # nested inside a span already removed
            continue
        pieces.append(text[cursor:start])
        pieces.append(replacement)
        cursor = end
    pieces.append(text[cursor:])
    return "".join(pieces)


def remove_hidden_links(text: str) -> str:
    """Delete ``[[File:..]]``, ``[[Image:..]]``, ``[[Category:..]]``, ``[[Media:..]]`` with their captions.

    Bracket counting over ``[[``/``]]`` tokens, so captions may hold nested links and stray
    single brackets ("... in 1927 [above] ...").
    """
    spans: list[tuple[int, int]] = []
    start, depth = None, 0
    for match in _LINK_TOKENS.finditer(text):
        if match.group() == "[[":
            if start is not None:
                depth += 1
            elif _HIDDEN_LINK_START.match(text, match.end()):
                start, depth = match.start(), 1
        elif start is not None:
            depth -= 1
            if depth == 0:
                spans.append((start, match.end()))
                start = None
    pieces, cursor = [], 0
    for span_start, span_end in spans:
        pieces.append(text[cursor:span_start])
        cursor = span_end
    pieces.append(text[cursor:])
    return "".join(pieces)


def _link_replacement(match: re.Match) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    if target.startswith(":"):  # [[:Category:X]] is a visible link to the category page
        return label or target[1:]
    namespace, has_namespace, _ = target.partition(":")
    namespace = namespace.strip()
    if has_namespace and namespace.lower() in _HIDDEN_LINK_NAMESPACES:
        return ""
    if has_namespace and not label and _INTERLANGUAGE_PREFIX.match(namespace):
        return ""  # [[de:Anarchismus]]: a link to another language edition
    return label if label else target


def replace_links(text: str) -> str:
    """Resolve ``[[...]]`` links innermost first, so a file caption's links vanish with the file."""
    while True:
        replaced = _INNERMOST_LINK.sub(_link_replacement, text)
        if replaced == text:
            return text
        text = replaced


def _remove_markup(text: str) -> str:
    text = _COMMENT.sub("", text)
    text = _SELF_CLOSING.sub("", text)
    for pattern in _ELEMENT_PATTERNS:
        text = pattern.sub("", text)
    text = remove_nested(text, _TEMPLATE_TOKENS, "{")
    text = remove_nested(text, _TABLE_TOKENS, "{")
    text = remove_hidden_links(text)
    text = replace_links(text)
    text = _EXTERNAL_LINK.sub(lambda match: match.group(1) or "", text)
    text = _BARE_URL.sub("", text)
    text = _HTML_TAG.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _EMPHASIS.sub("", text)
    return html.unescape(text)


def _normalize_line(line: str) -> str:
    line = _SPACES.sub(" ", line).strip()
    line = _EMPTY_PARENS.sub("", line)  # "(  )" left where a template or ref used to be
    line = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", line)
    return _SPACES.sub(" ", line).strip()


def clean_wikitext(text: str, min_words: int = DEFAULT_MIN_WORDS) -> str:
    """Plain prose of one article: one paragraph (or kept heading) per line, in source order.

    ``min_words``: body lines with fewer words are dropped (residue such as "thumb|" or lone links).
    """
    lines_out: list[str] = []
    pending_heading: str | None = None
    in_back_matter = False
    for raw_line in _remove_markup(text).splitlines():
        heading = _HEADING.match(raw_line.strip())
        if heading:
            title = _normalize_line(heading.group(2))
            in_back_matter = title.lower() in BACK_MATTER_SECTIONS
            pending_heading = title if title and not in_back_matter else None
            continue
        stripped = raw_line.strip()
        # Table rows/cells outside a matched table, and horizontal rules, are not prose.
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
