"""Word (DOCX) and HTML documents to Markdown, and the zip-bomb check of DOCX, EPUB and XPS (zip archives).

- DOCX through python-docx (lxml underneath, with entity resolution off, so no billion-laughs expansion; libxml2's
  default limits refuse nesting past 256 levels): the body's paragraphs and tables in document order. Headings
  (`Title`, `Heading N` styles) become `#` lines, list paragraphs `- ` items, tables Markdown tables (a merged cell
  repeats its text in each column it spans, so columns stay aligned; a nested table's text joins its cell).
  Headers, footers, footnotes, comments and text boxes are left out, as page furniture is.
- HTML through trafilatura: the page's main text as Markdown (headings, lists, tables), without scripts, styles,
  navigation, headers, footers and other boilerplate. A page where it finds no main text (a bare list of links, a
  fragment) falls back to all of its visible text (trafilatura's `html2txt`: scripts and styles still dropped).
  Bytes are decoded as the page's BOM or `<meta charset>` says (the HTML standard's order; undecodable bytes of a
  declared encoding become U+FFFD as a browser shows them); a page that says nothing must be UTF-8, else it takes
  `input.fallback_encoding` or gets `decode_error`, as a text file does.
- A zip archive's parts are unpacked whole by python-docx and MuPDF; `check_zip` reads the sizes its directory
  declares first (Python's zipfile and MuPDF never unpack more than that) and refuses an archive that would unpack to
  more than the limit, so a small file cannot expand to gigabytes in the parse process.
"""

from __future__ import annotations

import codecs
import io
import re
import zipfile

from clover_batch.pipeline.parse import Parsed, clean, decode_text, looks_binary

_HEADING = re.compile(r"(?:Heading|heading)\s*([1-9])$")
_META_CHARSET = re.compile(rb"""<meta[^>]{0,512}?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]{1,40})""", re.I)
_CONFIG = None  # trafilatura's settings, made on first use (see _trafilatura_config)
_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


# ---- zip archives (DOCX, EPUB, XPS) ----

def check_zip(fmt: str, data: bytes, max_unpacked_bytes: int | None) -> Parsed | None:
    """None for a zip archive whose parts unpack within the limit, else the row's status."""
    name = fmt.upper()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            sizes = [info.file_size for info in archive.infolist()]
    except Exception as e:  # BadZipFile, and the struct/value errors of a mangled directory
        return Parsed(fmt, "corrupt_file", f"the {name} is not a readable zip archive: {type(e).__name__}: {e}")
    unpacked = sum(sizes)
    if max_unpacked_bytes is not None and unpacked > max_unpacked_bytes:
        return Parsed(fmt, "too_large", f"the {name}'s {len(sizes)} parts unpack to {unpacked} bytes, over "
                      f"input.max_file_bytes={max_unpacked_bytes} (a zip bomb?)")
    return None


# ---- DOCX ----

def parse_docx(data: bytes) -> Parsed:
    """A DOCX's body as Markdown (see the module docstring); `corrupt_file` for anything python-docx cannot read."""
    import docx

    try:
        document = docx.Document(io.BytesIO(data))
        blocks = [_docx_block(item) for item in document.iter_inner_content()]
    except Exception as e:  # missing parts, malformed XML, a wrong content type: python-docx's errors vary
        return Parsed("docx", "corrupt_file", f"cannot read the DOCX: {type(e).__name__}: {e}")
    text = clean("\n\n".join(b for b in blocks if b))
    if not text.strip():
        return Parsed("docx", "no_text", "the DOCX has no text in its paragraphs and tables")
    return Parsed("docx", "ok", text=text, text_source="text")


def _docx_block(item) -> str:
    from docx.text.paragraph import Paragraph

    if isinstance(item, Paragraph):
        return _docx_paragraph(item)
    return _docx_table(item)


def _docx_paragraph(paragraph) -> str:
    text = " ".join(paragraph.text.split())
    if not text:
        return ""
    style = paragraph.style.name if paragraph.style is not None else ""
    if style == "Title":
        return f"# {text}"
    heading = _HEADING.match(style or "")
    if heading:
        return f"{'#' * int(heading.group(1))} {text}"
    p_pr = paragraph._p.pPr  # a numbering reference makes a list item whatever its style is called
    if (style or "").startswith("List") or (p_pr is not None and p_pr.numPr is not None):
        return f"- {text}"
    return text


def _docx_cell(cell) -> str:
    parts = [" ".join(p.text.split()) for p in cell.paragraphs]
    parts += [_docx_cell(inner) for table in cell.tables for row in table.rows for inner in row.cells]
    return " ".join(p for p in parts if p).replace("|", "\\|")


def _docx_table(table) -> str:
    rows = [[_docx_cell(cell) for cell in row.cells] for row in table.rows]
    rows = [r for r in rows if any(r)]
    if not rows:
        return ""
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * width)
    return "\n".join(lines)


# ---- HTML ----

def _declared_encoding(data: bytes) -> str | None:
    """The encoding a BOM or a `<meta charset>` in the first 1024 bytes names (known to Python), else None."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return encoding
    match = _META_CHARSET.search(data[:1024])
    if match is None:
        return None
    try:
        name = codecs.lookup(match.group(1).decode("ascii")).name
    except (LookupError, UnicodeDecodeError):
        return None
    # the HTML standard: a page whose bytes were read as ASCII to find this cannot be UTF-16/32
    return "utf-8" if name.startswith(("utf-16", "utf-32")) else name


def _trafilatura_config():
    """trafilatura's defaults, except: a short page's text counts (it drops main text under 250 characters, made for
    web articles), and input.max_file_bytes, not its own 20 MB, limits a page's size."""
    global _CONFIG
    if _CONFIG is None:
        from trafilatura.settings import use_config

        _CONFIG = use_config()
        _CONFIG.set("DEFAULT", "min_extracted_size", "1")
        _CONFIG.set("DEFAULT", "max_file_size", str(2**40))
    return _CONFIG


def parse_html(data: bytes, fallback_encoding: str | None) -> Parsed:
    """An HTML page's main text as Markdown (see the module docstring)."""
    declared = _declared_encoding(data)
    if declared is None or not declared.startswith("utf-16"):
        if looks_binary(data):
            return Parsed("html", "binary", "the file holds binary data (NUL or control bytes), not HTML")
    if declared is not None:
        html = data.decode(declared, errors="replace").removeprefix("\ufeff")
    else:
        html = decode_text("html", data, fallback_encoding)
        if isinstance(html, Parsed):
            return html
    import trafilatura

    try:
        text = trafilatura.extract(html, output_format="markdown", include_tables=True, include_formatting=True,
                                   include_links=False, include_images=False, include_comments=False,
                                   favor_recall=True, deduplicate=False, with_metadata=False,
                                   config=_trafilatura_config())
        if not text or not text.strip():
            text = trafilatura.html2txt(html)
    except Exception as e:  # lxml's parser errors on pages it cannot build a tree from
        return Parsed("html", "corrupt_file", f"cannot read the HTML: {type(e).__name__}: {e}")
    text = clean((text or "").strip())
    if not text:
        return Parsed("html", "no_text", "the HTML page has no visible text")
    return Parsed("html", "ok", text=text, text_source="text")
