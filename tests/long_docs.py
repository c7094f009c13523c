"""Long documents for the page-range tests and bench/parse_formats.py, drawn by pymupdf (seeded, nothing committed).

`book_pdf(pages)`: a book whose pages hold a running header, a section heading, paragraphs, and the things a page
break can cut: a paragraph that ends on the next page, and (every `table_every` pages) a ruled table whose rows go
on at the top of the next page. Chapter titles every 25 pages are the largest headings, so a page range without
one ranks its headings differently from the whole book: the join must use the book's levels.
"""

from __future__ import annotations

import random

import pymupdf

WORDS = ("the tenant shall pay rent on the first day of each month to the landlord at the address given in clause "
         "four unless notice in writing is served no later than thirty days before the renewal date").split()


def _table(page: pymupdf.Page, top: float, rows: list[list[str]]) -> float:
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            rect = pymupdf.Rect(50 + 120 * c, top + 20 * r, 170 + 120 * c, top + 20 + 20 * r)
            page.draw_rect(rect, color=(0, 0, 0), width=0.7)
            page.insert_text((rect.x0 + 4, rect.y1 - 6), cell, fontsize=9)
    return top + 20 * len(rows)


def book_pdf(pages: int, *, table_every: int = 50, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    doc = pymupdf.open()
    carry_rows: list[list[str]] = []
    for n in range(pages):
        page = doc.new_page()
        page.insert_text((50, 30), "Clover Batch Handbook", fontsize=8)
        y = 60.0
        if carry_rows:  # the table of the page before goes on here, before anything else
            y = _table(page, y, carry_rows) + 20
            carry_rows = []
        elif n:  # the paragraph of the page before ends here
            y = _paragraph(page, y, "pay for repairs that are needed because of normal wear.")
        if n % 25 == 0:
            page.insert_text((50, y + 10), f"Chapter {n // 25 + 1}: Terms", fontsize=20)
            y += 40
        page.insert_text((50, y + 6), f"Section {n + 1}.1 Rent and notice", fontsize=14)
        y += 24
        body = f"Page {n + 1} begins. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))) + "."
        y = _paragraph(page, y, body)
        if n % table_every == table_every - 1 and n + 1 < pages:  # a table cut by the page break
            rows = [["Quarter", "Units", "Price", "Total"]] + [
                [f"Q{q} {2000 + n}", str(rng.randint(10, 999)), f"{rng.randint(5, 90)} EUR", f"{rng.randint(1, 90)}k"]
                for q in range(1, 4)]
            _table(page, 700, rows)
            carry_rows = [[f"Q4 {2000 + n}", str(rng.randint(10, 999)), f"{rng.randint(5, 90)} EUR",
                           f"{rng.randint(1, 90)}k"], ["Year", "", "", f"{rng.randint(100, 900)}k"]]
        else:  # a paragraph cut by the page break: its last words are on the next page
            _paragraph(page, max(y, 700), "The rent is due on the first day of the month and the landlord shall")
    return doc.tobytes(garbage=3, deflate=True)


def _paragraph(page: pymupdf.Page, y: float, text: str) -> float:
    rect = pymupdf.Rect(50, y, 550, 790)
    left = page.insert_textbox(rect, text, fontsize=10)
    return rect.y1 - left + 12 if left >= 0 else rect.y1
