"""The wiki markup cleaner (mwparserfromhell + our keep/drop policy) on small hand-written wikitext samples."""

from __future__ import annotations

from retrofitter.data.wikitext import clean_wikitext, prose_lines, strip_markup


def test_nested_templates_are_removed_whole():
    text = "{{Infobox person|name={{nowrap|Ada {{small|King}}}}|born=1815}}Ada Lovelace was a mathematician."
    assert clean_wikitext(text, min_words=1) == "Ada Lovelace was a mathematician."


def test_unclosed_template_keeps_text_but_removes_closed_inner_ones():
    assert strip_markup("a {{b {{c}} d") == "a {{b   d"
    assert strip_markup("x }} y") == "x }} y"


def test_refs_self_closing_refs_and_comments():
    text = ('Paris is the capital of France.<ref name="a">{{cite web|url=http://x}}</ref> It is large'
            '<ref name=b/> and old.<!-- hidden\ncomment --> Really.')
    assert clean_wikitext(text, min_words=1) == "Paris is the capital of France. It is large and old. Really."


def test_tables_are_removed():
    text = "Before the table comes prose.\n{| class=\"wikitable\"\n|-\n! Year !! Value\n|-\n| 1900 || 3\n|}\nAfter the table more prose."
    assert clean_wikitext(text, min_words=1) == "Before the table comes prose.\nAfter the table more prose."


def test_links_labels_files_categories_and_nested_captions():
    text = ("The [[United Kingdom|UK]] borders [[Ireland]] and the [[sea]]s. "
            "[[File:Map.png|thumb|A map of the [[United Kingdom|UK]] in 1927 [above] with [[Wales]]]]"
            "[[Category:Countries]][[de:Vereinigtes Königreich]] See [[:Category:Islands]].")
    assert clean_wikitext(text, min_words=1) == "The UK borders Ireland and the seas. See Category:Islands."


def test_link_labels_and_hidden_links():
    assert strip_markup("[[a|[[b]]]]") == "b"
    assert strip_markup("[[wikt:anarchy|anarchy]] and [[Image:x.jpg]]") == "anarchy and "
    assert strip_markup("a [[image:x.png|cap [[y]] in 1927 [above] z]] b") == "a  b"
    assert strip_markup("[[Pipe trick|]] [[ Media:a.ogg|listen]] [[fr:Paris]] [[Paris#History]]") == "Pipe trick   Paris#History"


def test_unbalanced_emphasis_does_not_break_refs():
    # MediaWiki closes an unbalanced '' at the end of the line; with style parsing on, mwparserfromhell
    # gives up on such a <ref> when a later line has emphasis, and the ref is left in the text.
    text = "Prose before.<ref>[http://x.org ''Title\"], Publisher.</ref>\n* An author. ''A Book''. Publisher (2011)."
    assert clean_wikitext(text, min_words=1) == "Prose before.\nAn author. A Book. Publisher (2011)."
    assert clean_wikitext("Prose.<ref>''Title</ref>\nA ''Book''.", min_words=1) == "Prose.\nA Book."


def test_external_links_html_emphasis_entities():
    text = ("'''Bold''' and ''italic'' text, see [http://example.org the site] or [https://bare.org] "
            "<small>small words</small><br />&nbsp;&ndash; done")
    assert clean_wikitext(text, min_words=1) == "Bold and italic text, see the site or small words – done"


def test_headings_lists_short_lines_and_back_matter():
    text = ("Intro line with enough words here.\n"
            "== History ==\n"
            "* A list item that is long enough.\n"
            "#: nested numbered item also long enough\n"
            "Short.\n"
            "=== Empty section ===\n"
            "== References ==\n"
            "* Some book that should be dropped entirely\n"
            "== Legacy ==\n"
            "The legacy section has prose too.\n")
    assert clean_wikitext(text).splitlines() == [
        "Intro line with enough words here.",
        "History",
        "A list item that is long enough.",
        "nested numbered item also long enough",
        "Legacy",
        "The legacy section has prose too.",
    ]


def test_cleaning_is_deterministic_and_whitespace_collapsed():
    text = "Some   text {{x}} with\tgaps ( {{y}} ) and a ref<ref>r</ref> ."
    assert clean_wikitext(text, min_words=1) == "Some text with gaps and a ref."
    assert clean_wikitext(text) == clean_wikitext(text)


def test_prose_lines_alone_takes_markup_free_text():
    text = "== See also ==\nsome list of related pages\n== History ==\n*  it began long ago here"
    assert prose_lines(text) == "History\nit began long ago here"
