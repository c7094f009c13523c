"""Regenerate the example documents in jobs/examples/docs (run once; the outputs are committed)."""

from pathlib import Path

import pymupdf

DOCS = Path(__file__).parent / "docs"

LEASE = [
    "COMMERCIAL LEASE AGREEMENT",
    "This lease is made on 1 March 2026 between Harbour Properties Ltd (the Landlord) and Northwind Analytics "
    "(the Tenant) for the office premises at 14 Quay Street, Unit 3.",
    "Term: thirty-six months starting 1 April 2026. Rent: 4,200 EUR per month, payable in advance on the first "
    "business day of each month. Deposit: three months' rent.",
    "The Tenant may end the lease after eighteen months with six months' written notice. The Landlord maintains "
    "the roof and structure; the Tenant maintains the interior.",
]
REPORT_PAGES = [
    ["Quarterly Operations Report, Q3 2026", "Shipments grew 12% over Q2, driven by the new Rotterdam hub.",
     "On-time delivery reached 96.1%, up from 93.4%."],
    ["Costs", "Fuel costs fell 4%. Warehouse staffing rose by 18 people to cover the new hub.",
     "Claims for damaged goods were flat at 0.3% of shipments."],
    ["Outlook", "We expect Q4 volume to rise 8% with the holiday season; a second sorting line opens in November."],
]


def write_pdf(path: Path, pages: list[list[str]]) -> None:
    doc = pymupdf.open()
    for lines in pages:
        page = doc.new_page()
        page.insert_textbox(pymupdf.Rect(72, 72, 540, 770), "\n\n".join(lines), fontsize=11)
    doc.save(path, garbage=4, deflate=True)


def main() -> None:
    DOCS.mkdir(exist_ok=True)
    write_pdf(DOCS / "lease-agreement.pdf", [LEASE])
    write_pdf(DOCS / "operations-report.pdf", REPORT_PAGES)
    (DOCS / "meeting-notes.txt").write_text(
        "Meeting notes, 2 November 2026\n\nAttendees: Ana, Bo, Chidi.\n"
        "Decisions: move the release to 20 November; Bo owns the migration plan; "
        "Chidi reviews the on-call rota by Friday.\n"
    )
    (DOCS / "product-faq.md").write_text(
        "# Product FAQ\n\n## What does the batch service do?\nIt summarizes long documents.\n\n"
        "## Which formats?\nPDF, plain text and Markdown.\n"
    )
    # Longer than the tiny preset's 256-token window, so its prompt spans several windows.
    paragraphs = [
        f"Section {i}. The committee reviewed item {i} of the annual plan, noting the budget of {1000 + 37 * i} "
        f"EUR, the owner team {'ABCDEFGH'[i % 8]}, and a deadline in week {(i * 7) % 52 + 1}. "
        "Risks were discussed and mitigations agreed; progress will be reported at the next meeting."
        for i in range(1, 4)
    ]
    (DOCS / "annual-plan-minutes.txt").write_text("Annual plan review minutes\n\n" + "\n\n".join(paragraphs) + "\n")


if __name__ == "__main__":
    main()
