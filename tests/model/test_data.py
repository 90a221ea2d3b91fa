"""The Shakespeare corpus: Gutenberg headers stripped, split by whole plays."""

from __future__ import annotations

import pytest

from model.training.data import VAL_PLAYS, load_plays, strip_gutenberg


def test_strip_gutenberg_header_and_footer():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nLicence text\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nHAMLET\r\nHam. To be.\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n")
    assert strip_gutenberg(raw) == "HAMLET\nHam. To be.\n"


def test_text_without_markers_is_kept_whole():
    assert strip_gutenberg("Rom.\nBut soft!\n\n") == "Rom.\nBut soft!\n"


@pytest.mark.corpus
def test_split_holds_out_whole_plays_about_ten_percent():
    plays = load_plays()
    assert len(plays) == 42
    assert not any(name.endswith("_f") for name in plays)  # First Folio duplicates skipped
    assert not any("Project Gutenberg" in text[:2000] for text in plays.values())
    val = sum(len(plays[p]) for p in VAL_PLAYS)
    total = sum(len(t) for t in plays.values())
    assert 0.08 < val / total < 0.12
    assert "Romeo" in plays["romeo_and_juliet"] and "Ham." in plays["hamlet"]
