"""OCR of PDF pages that have no usable text layer: the decision, the recognition, and the text put back on the page.

- Back end: RapidOCR (`rapidocr` on PyPI) on onnxruntime. Its wheel ships its default models (PP-OCRv6 small text
  detection and recognition, a direction classifier), so recognition works offline after `pip install`: nothing is
  downloaded on first use. Tesseract would need a system package on every worker. The engine is created once per
  parse process, on the first page that needs it, with one onnxruntime thread: a parse child serves one worker.
- Decision (`auto`): pymupdf4llm's page analysis (it ships with pymupdf): a page needs OCR when most of its text is
  U+FFFD (a font without a usable ToUnicode map), or when it holds images or drawings that its small onnx model
  judges to be text; a page with an intact text layer, or an OCR layer made earlier by another tool, is left alone.
- Recognition draws the page at `OCR_DPI` with its good text removed (so text that is already there is not read
  twice), recognises lines, drops the page's unreadable text, and writes each line onto the page as text in its box
  (width-scaled), as pymupdf4llm's own `exec_ocr_full` does. The page then reads like any text page, so plain text
  and Markdown extraction (layout, reading order, tables) work on scans unchanged.
- `always` recognises every page from its picture and replaces its whole text layer with what was recognised (for a
  text layer that is wrong in ways the check cannot see).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pymupdf

log = logging.getLogger(__name__)

OCR_MODES = ("auto", "always", "never")
OCR_DPI = 150  # page pictures for recognition; 12 pt text is 25 px high
# Detection scales the picture so its longer side is at most this: 2.5x faster than the engine's default (shorter
# side at least 736 px, so a whole 150-dpi page) and still finds 7 pt text on a letter page.
DETECT_MAX_SIDE = 1280
FFFD = "\ufffd"
_FONT_NAME = "clover-ocr"
_NOWHERE = (-2.0, -2.0, -1.0, -1.0)  # a culling rectangle off the page: cull no text


@dataclass(frozen=True)
class PageOcr:
    """What OCR did to one page it ran on."""

    ocr_chars: int  # characters of recognised text written onto the page
    layer_chars: int  # characters of the page's own text layer still on it (not replaced, not unreadable)


class Recogniser:
    """RapidOCR, created on first use (its import and model load cost about a second)."""

    def __init__(self) -> None:
        self._engine: Any = None
        self._font: pymupdf.Font | None = None

    def lines(self, pix: pymupdf.Pixmap) -> list[tuple[list[list[float]], str]]:
        """(box corners in pixels, text) of each recognised line, in the engine's reading order."""
        import numpy as np

        if self._engine is None:
            from rapidocr import RapidOCR

            self._engine = RapidOCR(params={
                "Global.log_level": "critical",
                "EngineConfig.onnxruntime.intra_op_num_threads": 1,
                "EngineConfig.onnxruntime.inter_op_num_threads": 1,
                "Det.limit_type": "max",
                "Det.limit_side_len": DETECT_MAX_SIDE,
            })
        img = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)
        result = self._engine(img)
        if result.boxes is None or result.txts is None:
            return []
        return [(box.tolist() if hasattr(box, "tolist") else box, text)
                for box, text in zip(result.boxes, result.txts, strict=True) if text.strip()]

    @property
    def font(self) -> pymupdf.Font:
        """A font with glyphs for any script the recogniser reads (MuPDF's built-in Droid Sans Fallback)."""
        if self._font is None:
            self._font = pymupdf.Font("cjk")
        return self._font


def _spans(page: pymupdf.Page) -> list[dict]:
    flags = pymupdf.TEXT_ACCURATE_BBOXES | pymupdf.TEXT_MEDIABOX_CLIP
    return [s for b in page.get_text("dict", flags=flags)["blocks"] if b["type"] == 0
            for line in b["lines"] for s in line["spans"] if s["text"].strip()]


def _invisible(span: dict) -> bool:
    """Text drawn neither filled nor stroked (render mode 3) or fully transparent: an earlier tool's OCR layer."""
    flags = span.get("char_flags", 0)
    return span.get("alpha", 255) == 0 or not (flags & (pymupdf.mupdf.FZ_STEXT_STROKED | pymupdf.mupdf.FZ_STEXT_FILLED))


def needs_ocr(page: pymupdf.Page) -> bool:
    """pymupdf4llm's decision: True for a page without a usable text layer (see the module docstring)."""
    from pymupdf4llm.ocr.analyze_page import analyze_page

    return bool(analyze_page(page)["needs_ocr"])


def ocr_page(page: pymupdf.Page, recogniser: Recogniser, *, replace_text: bool, dpi: int = OCR_DPI) -> PageOcr:
    """Recognise the page and write the lines onto it (see the module docstring)."""
    from pymupdf4llm.ocr.get_culled_pixmap import get_pixmap

    spans = _spans(page)
    keep = [not replace_text and FFFD not in s["text"] and not _invisible(s) for s in spans]
    good = [s for s, k in zip(spans, keep, strict=True) if k]
    drop = [s for s, k in zip(spans, keep, strict=True) if not k]
    layer_chars = sum(len(s["text"].strip()) for s in good)
    # The page drawn without its good text (not read twice): a scan's picture, unreadable glyphs, and whatever else
    # is not text yet. pymupdf4llm's renderer also lowers the dpi of a huge page to stay under 10 megapixels.
    pix, empty = get_pixmap(page.get_displaylist(), dpi=dpi, rects=[s["bbox"] for s in good] or [_NOWHERE])
    if empty:
        return PageOcr(0, layer_chars)
    lines = recogniser.lines(pix)
    if drop:
        for span in drop:
            page.add_redact_annot(span["bbox"])
        page.apply_redactions(images=pymupdf.PDF_REDACT_IMAGE_NONE, graphics=pymupdf.PDF_REDACT_LINE_ART_NONE,
                              text=pymupdf.PDF_REDACT_TEXT_REMOVE)
    if not lines:
        return PageOcr(0, layer_chars)
    to_page = pymupdf.Rect(pix.irect).torect(page.rect)
    page.insert_font(fontname=_FONT_NAME, fontbuffer=recogniser.font.buffer)
    chars = 0
    for box, text in lines:
        rect = pymupdf.Rect(min(p[0] for p in box), min(p[1] for p in box),
                            max(p[0] for p in box), max(p[1] for p in box)) * to_page
        if rect.is_empty:
            continue
        size = rect.height
        width = recogniser.font.text_length(text, size)
        # the line's text stretched to its box, so layout analysis sees it where the picture has it
        scale = pymupdf.Matrix(rect.width / width, 1) if width > 0 else pymupdf.Identity
        page.insert_text(rect.bl + pymupdf.Point(0, -0.2 * size), text, fontsize=size, fontname=_FONT_NAME,
                         morph=(rect.bl, scale))
        chars += len(text.strip())
    return PageOcr(chars, layer_chars)


def recognise_document(doc: pymupdf.Document, mode: str, recogniser: Recogniser,
                       pages: range | None = None) -> list[PageOcr | None]:
    """Run the OCR decision and recognition over the pages of a PDF (all, or `pages`), changing them in memory: per
    page, in order, what OCR did, or None where it did not run. `never` changes nothing."""
    pages = range(doc.page_count) if pages is None else pages
    if mode == "never":
        return [None] * len(pages)
    return [ocr_page(page, recogniser, replace_text=mode == "always") if mode == "always" or needs_ocr(page) else None
            for page in (doc[n] for n in pages)]
