"""Synthetic business documents with target answers: the corpus the `demo` checkpoint is trained and evaluated on.

Five kinds (invoice, lease agreement, meeting minutes, incident report, purchase order), each drawn from pools
of names, companies, places, dates, amounts, phrasings and filler text. Every document carries its fields, from
which its two targets are built: one summary sentence and one extraction JSON object with the fields of
`EXTRACT_FIELDS` (the fields of jobs/examples/extract-local.yaml).

- Seeded and reproducible: `make_document(seed)` depends on nothing but its seed. Training draws seeds from
  `TRAIN_SEEDS`, evaluation from `HELD_OUT_SEEDS` (disjoint ranges), so held-out documents are new combinations
  of the same pools (names, companies and phrasings are shared; what is held out is each document).
- A `long` document puts its facts first and then enough filler (an operations log, notes) that its answer lies
  more than a window of tokens after them: only a model that carries them in its GDN state can answer.
- `wrap` hard-wraps lines and drops blank lines as text extracted from a PDF comes (pymupdf keeps the layout's
  line breaks), so the model sees both forms; some plain documents get a markdown `# ` title.
"""

from __future__ import annotations

import json
import random
import textwrap
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

KINDS = ("invoice", "lease agreement", "meeting minutes", "incident report", "purchase order")

# The extraction schema of jobs/examples/extract-local.yaml (a test keeps the two equal).
EXTRACT_FIELDS: dict[str, dict[str, Any]] = {
    "document_type": {"type": "string", "description": "Kind of document"},
    "date": {"type": "string", "description": "Date issued, YYYY-MM-DD"},
    "parties": {"type": "list[string]", "description": "Parties or attendees"},
    "amount_eur": {"type": "number", "description": "Main amount in EUR", "required": False},
    "deadline": {"type": "string", "description": "Due date, YYYY-MM-DD", "required": False},
}

TRAIN_SEEDS = range(0, 10_000_000)
HELD_OUT_SEEDS = range(1_000_000_000, 1_000_100_000)
EXAMPLE_SEEDS = range(2_000_000_000, 2_000_100_000)  # jobs/examples/docs
FRESH_SEEDS = range(3_000_000_000, 3_000_100_000)  # bench/demo_jobs.py: never trained, evaluated or an example

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")

FIRST = ("Ana", "Bo", "Chidi", "Dara", "Elena", "Femi", "Greta", "Hugo", "Ines", "Jonas", "Kasia", "Luca", "Maya",
         "Nils", "Olga", "Pedro", "Rosa", "Sami", "Tomas", "Ulla", "Vera", "Wim", "Yara", "Zofia", "Aisha", "Ben",
         "Clara", "David", "Emil", "Fatima", "Georg", "Hana", "Ivan", "Julia", "Karim", "Lena", "Marek", "Nora",
         "Oscar", "Priya", "Quentin", "Rania", "Stefan", "Tara", "Omar", "Sofia", "Leo", "Mina", "Anton", "Irene")
LAST = ("Lopez", "Chen", "Okafor", "Novak", "Rossi", "Adeyemi", "Berg", "Martin", "Silva", "Weber", "Kowalski",
        "Bianchi", "Haddad", "Larsen", "Petrova", "Santos", "Moreau", "Nakamura", "Fischer", "Jansen", "Dubois",
        "Horvat", "Costa", "Lindqvist", "Murphy", "Schmidt", "Varga", "Yilmaz", "Kovacs", "Ibrahim", "Keller",
        "Nowak", "Ferreira", "Andersen", "Popescu", "Meyer", "Garcia", "Brennan", "Hoffmann", "Sato")
COMPANY_A = ("Harbour", "Northwind", "Blue Ridge", "Silverline", "Oakfield", "Redstone", "Greenway", "Brightwater",
             "Stonebridge", "Westgate", "Clearview", "Ironwood", "Maple", "Lakeside", "Summit", "Riverbend",
             "Cedar", "Falcon", "Granite", "Meridian", "Pioneer", "Sunrise", "Kestrel", "Atlas", "Beacon")
COMPANY_B = ("Properties", "Analytics", "Logistics", "Supplies", "Foods", "Engineering", "Media", "Textiles",
             "Systems", "Energy", "Robotics", "Pharma", "Printing", "Furniture", "Consulting", "Metals",
             "Software", "Transport", "Design", "Labs")
COMPANY_C = ("Ltd", "GmbH", "BV", "SA", "Group", "AG", "Oy", "plc", "& Co", "SRL")
CITIES = ("Rotterdam", "Lyon", "Hamburg", "Porto", "Gdansk", "Turin", "Ghent", "Malmo", "Leipzig", "Bilbao",
          "Utrecht", "Graz", "Tallinn", "Cork", "Brno", "Aarhus", "Nantes", "Bologna", "Krakow", "Seville")
STREETS = ("Quay Street", "Mill Lane", "Station Road", "Harbour Way", "Market Square", "Canal Street", "Park Avenue",
           "Bridge Road", "Church Lane", "Dock Road", "Elm Street", "Factory Lane", "King Street", "Orchard Way")
PREMISES = ("office premises", "warehouse", "retail unit", "workshop", "storage hall", "studio")
ITEMS = (("office chairs", 90, 400), ("laptops", 600, 2400), ("pallets of paper", 40, 160),
         ("safety helmets", 12, 60), ("server racks", 900, 3000), ("forklift batteries", 700, 2600),
         ("desk lamps", 15, 90), ("monitors", 120, 700), ("steel beams", 150, 900), ("cleaning kits", 20, 80),
         ("printer cartridges", 25, 120), ("network switches", 200, 1500), ("work boots", 40, 150),
         ("shelving units", 80, 500), ("coffee machines", 150, 1200))
SERVICES = ("consulting services", "software licences", "cleaning services", "transport services",
            "maintenance work", "design work", "training sessions", "catering services", "security services",
            "cloud hosting")
COMMITTEES = ("Finance Committee", "Board of Directors", "Operations Committee", "Steering Group",
              "Safety Committee", "Product Council", "Works Council", "Audit Committee")
PROJECTS = ("the new warehouse", "the website redesign", "the staff training plan", "the fleet renewal",
            "the solar panels", "the customer portal", "the office move", "the data migration",
            "the safety audit", "the marketing campaign")
DECISIONS = ("move the product launch to the next quarter", "hire two more engineers", "close the Lyon office",
             "renew the cleaning contract", "switch to a new payroll provider", "open a second shift",
             "freeze travel spending", "adopt the new security policy", "extend the pilot for three months",
             "publish the annual report early")
ACTIONS = ("send the revised budget", "prepare the migration plan", "review the on-call rota",
           "draft the supplier contract", "book the venue", "collect the team feedback",
           "update the risk register", "circulate the minutes", "order the new equipment",
           "write the project brief")
INCIDENTS = ("power outage", "water leak", "server failure", "forklift collision", "fire alarm",
             "roof collapse", "network outage", "chemical spill", "conveyor breakdown", "cooling failure")
SITES = ("warehouse", "head office", "distribution centre", "factory", "data centre", "depot", "laboratory")
FOLLOW_UPS = ("replace the damaged cables", "inspect the roof", "retrain the drivers", "install a backup generator",
              "repair the cooling unit", "update the emergency plan", "check the sprinklers",
              "replace the conveyor belt", "audit the storage area", "test the alarm system")

FILLER = (
    "All parties confirmed that the information in this document is complete.",
    "Questions about this document should be sent to the office that issued it.",
    "The figures were checked against the records kept by the finance team.",
    "Copies of this document are kept on file for seven years.",
    "Staff were reminded to follow the usual procedures.",
    "The team thanked everyone involved for their cooperation.",
    "No other matters were raised at this point.",
    "Further details are available in the attached appendix.",
    "The document was prepared by the administration team.",
    "Work continued as planned during the rest of the week.",
    "Suppliers were informed of the schedule by email.",
    "The site was cleaned and inspected afterwards.",
    "Weekly reports will continue to be shared with all teams.",
    "The usual terms and conditions apply.",
    "Everyone agreed that communication had improved since last year.",
    "The quality checks found no further problems.",
    "Parking at the site remains limited during working hours.",
    "The heating system was serviced as part of the routine maintenance.",
    "New visitors must sign in at the front desk.",
    "The internal newsletter will describe the changes next month.",
    "The cleaning schedule stays the same for now.",
    "Training material is available on the shared drive.",
    "The printer on the second floor has been replaced.",
    "A short coffee break followed this item.",
    "The lights in the corridor were repaired last week.",
    "All equipment was returned to the storage room.",
    "The emergency exits were checked and found clear.",
    "Several staff members asked for clearer instructions.",
    "The schedule will be reviewed again at the end of the season.",
    "Deliveries arrived on time throughout the period.",
)
LOG_ENTRIES = (
    "Routine inspection of the loading bays, nothing to report.",
    "Shift handover completed without issues.",
    "Stock count of aisle {n} matched the system records.",
    "Visitor from the insurance office was shown around the site.",
    "Cleaning crew finished the floor in hall {n}.",
    "Temperature in storage room {n} stayed within limits.",
    "Two pallets were moved to bay {n} for the weekly dispatch.",
    "The night guard reported all doors locked.",
    "Maintenance replaced a light fitting in corridor {n}.",
    "A delivery truck waited twenty minutes at gate {n}.",
    "Fire doors on level {n} were tested and closed properly.",
    "Printer in office {n} was refilled with paper.",
    "The canteen opened late because of a staff meeting.",
    "Rubbish containers were emptied by the city service.",
    "A short team briefing took place at the start of the shift.",
)


@dataclass
class Document:
    """One synthetic document: its text, its kind and fields, and the two target answers."""

    seed: int
    kind: str
    text: str
    title: str  # a short file-name-like title (for example files)
    fields: dict[str, Any]  # the EXTRACT_FIELDS values (dates as YYYY-MM-DD)
    summary: str  # the target summary sentence
    facts_end: int = 0  # characters of `text` up to the last fact a target uses
    # the facts the summary states, each (kind, text as the summary writes it); kind: name, amount, date or other
    summary_facts: list[tuple[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def extraction(self) -> str:
        """The target extraction answer: one JSON object, keys in EXTRACT_FIELDS order."""
        return json.dumps({k: self.fields[k] for k in EXTRACT_FIELDS}, ensure_ascii=False)


# ---- small pools ------------------------------------------------------------------------------------------------


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _people(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        p = _person(rng)
        if p not in out:
            out.append(p)
    return out


def _company(rng: random.Random) -> str:
    return f"{rng.choice(COMPANY_A)} {rng.choice(COMPANY_B)} {rng.choice(COMPANY_C)}"


def _companies(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        c = _company(rng)
        if all(c.split()[0] != o.split()[0] for o in out):
            out.append(c)
    return out


def _date(rng: random.Random) -> date:
    return date(2024, 1, 1) + timedelta(days=rng.randrange(0, 3 * 365))


def fmt_date(d: date) -> str:
    """The canonical written form used in summaries: 3 March 2026."""
    return f"{d.day} {MONTHS[d.month - 1]} {d.year}"


def _doc_date(rng: random.Random, d: date) -> str:
    """How a document writes a date: mostly `3 March 2026`, sometimes `March 3, 2026`."""
    return fmt_date(d) if rng.random() < 0.7 else f"{MONTHS[d.month - 1]} {d.day}, {d.year}"


def fmt_eur(amount: int) -> str:
    return f"{amount:,}"


def _amount(rng: random.Random, lo: int, hi: int, step: int = 10) -> int:
    return rng.randrange(lo // step, hi // step + 1) * step


def _address(rng: random.Random) -> str:
    return f"{rng.randrange(1, 120)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"


def _filler(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(FILLER) for _ in range(n)]


def _paragraphs(sentences: list[str], rng: random.Random) -> list[str]:
    """Group sentences into paragraphs of 2-4."""
    out, i = [], 0
    while i < len(sentences):
        k = rng.randint(2, 4)
        out.append(" ".join(sentences[i:i + k]))
        i += k
    return out


def _log(rng: random.Random, n: int) -> list[str]:
    """An operations log of n entries after the facts (the long documents' bulk)."""
    lines = []
    for i in range(n):
        entry = rng.choice(LOG_ENTRIES).format(n=rng.randrange(1, 30))
        lines.append(f"Day {i // 3 + 1}, {rng.choice(('morning', 'afternoon', 'evening'))}: {entry}")
    return lines


# ---- the five kinds ------------------------------------------------------------------------------------------
# Each builder returns (title, fact paragraphs, fields, summary, the summary's facts); `make_document` adds filler
# and layout.


def _invoice(rng: random.Random):
    seller, buyer = _companies(rng, 2)
    number = f"INV-{rng.randrange(1000, 9999)}"
    issued = _date(rng)
    due = issued + timedelta(days=rng.choice((14, 21, 30, 45, 60)))
    lines, total = [], 0
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.6:
            item, lo, hi = rng.choice(ITEMS)
            qty = rng.randint(1, 40)
            unit = _amount(rng, lo, hi)
            lines.append(f"{qty} {item} at {fmt_eur(unit)} EUR each: {fmt_eur(qty * unit)} EUR")
            total += qty * unit
        else:
            service = rng.choice(SERVICES)
            cost = _amount(rng, 300, 9000)
            lines.append(f"{service.capitalize()}: {fmt_eur(cost)} EUR")
            total += cost
    header = rng.choice((f"INVOICE {number}", f"Invoice {number}", f"Invoice no. {number}"))
    issue_line = rng.choice((f"Invoice date: {_doc_date(rng, issued)}", f"Issued on {_doc_date(rng, issued)}",
                             f"Date: {_doc_date(rng, issued)}"))
    parties = rng.choice((f"From: {seller}, {_address(rng)}\nBill to: {buyer}, {_address(rng)}",
                          f"Seller: {seller}\nCustomer: {buyer}",
                          f"{seller} invoices {buyer} for the items below."))
    due_line = rng.choice((f"Payment is due by {_doc_date(rng, due)}.", f"Due date: {_doc_date(rng, due)}",
                           f"Please pay within {(due - issued).days} days, by {_doc_date(rng, due)}."))
    facts = [header, issue_line if rng.random() < 0.5 else parties, None, "\n".join(lines),
             f"Total due: {fmt_eur(total)} EUR", due_line]
    facts[2] = parties if facts[1] == issue_line else issue_line
    fields = {"document_type": "invoice", "date": issued.isoformat(), "parties": [seller, buyer],
              "amount_eur": total, "deadline": due.isoformat()}
    summary = (f"Invoice {number} from {seller} to {buyer} for {fmt_eur(total)} EUR is due on "
               f"{fmt_date(due)}.")
    said = [("other", number), ("name", seller), ("name", buyer), ("amount", fmt_eur(total)), ("date", fmt_date(due))]
    return f"invoice-{number.lower()}", facts, fields, summary, said


def _lease(rng: random.Random):
    landlord, tenant = _companies(rng, 2)
    signed = _date(rng)
    start = (signed.replace(day=1) + timedelta(days=32)).replace(day=1)
    months = rng.choice((12, 18, 24, 36, 48, 60))
    rent = _amount(rng, 800, 15000, 50)
    premises = rng.choice(PREMISES)
    address = _address(rng)
    deposit_months = rng.choice(("two", "three", "six"))
    deposit_due = signed + timedelta(days=rng.choice((7, 10, 14, 21))) if rng.random() < 0.6 else None
    header = rng.choice(("COMMERCIAL LEASE AGREEMENT", "Lease Agreement", "OFFICE LEASE", "LEASE"))
    intro = (f"This lease is made on {_doc_date(rng, signed)} between {landlord} (the Landlord) and {tenant} "
             f"(the Tenant) for the {premises} at {address}.")
    term = rng.choice((f"Term: {months} months starting {_doc_date(rng, start)}.",
                       f"The lease runs for {months} months from {_doc_date(rng, start)}."))
    rent_line = rng.choice((f"Rent: {fmt_eur(rent)} EUR per month, payable in advance on the first business day "
                            f"of each month.", f"The monthly rent is {fmt_eur(rent)} EUR, paid in advance."))
    deposit = f"Deposit: {deposit_months} months' rent"
    deposit += f", to be paid by {_doc_date(rng, deposit_due)}." if deposit_due else "."
    clauses = ["The Landlord maintains the roof and structure; the Tenant maintains the interior.",
               f"The Tenant may end the lease early with {rng.choice(('three', 'six'))} months' written notice."]
    rng.shuffle(clauses)
    facts = [header, intro, term + " " + rent_line, deposit, " ".join(clauses)]
    fields = {"document_type": "lease agreement", "date": signed.isoformat(), "parties": [landlord, tenant],
              "amount_eur": rent, "deadline": deposit_due.isoformat() if deposit_due else None}
    summary = (f"{tenant} leases the {premises} at {address} from {landlord} for {months} months from "
               f"{fmt_date(start)} at {fmt_eur(rent)} EUR per month.")
    said = [("name", tenant), ("other", premises), ("other", address), ("name", landlord),
            ("other", f"{months} months"), ("date", fmt_date(start)), ("amount", fmt_eur(rent))]
    return f"lease-{tenant.split()[0].lower()}", facts, fields, summary, said


def _minutes(rng: random.Random):
    org = _company(rng)
    committee = rng.choice(COMMITTEES)
    held = _date(rng)
    attendees = _people(rng, rng.randint(2, 4))
    owner = rng.choice(attendees)
    action = rng.choice(ACTIONS)
    deadline = held + timedelta(days=rng.randint(3, 40))
    budget = _amount(rng, 2000, 250000, 500) if rng.random() < 0.5 else None
    project = rng.choice(PROJECTS)
    decision = rng.choice(DECISIONS)
    header = rng.choice((f"Minutes of the {committee}, {org}", f"{org} - {committee} meeting minutes",
                         f"{committee} minutes"))
    when = rng.choice((f"Date: {_doc_date(rng, held)}", f"The {committee} of {org} met on {_doc_date(rng, held)}."))
    if header == f"{committee} minutes" and when.startswith("Date"):
        when += f"\nOrganisation: {org}"
    people = rng.choice((f"Attendees: {', '.join(attendees)}.", f"Present: {', '.join(attendees)}."))
    if budget is not None:
        decided = f"The committee approved a budget of {fmt_eur(budget)} EUR for {project}."
        outcome = f"approved a budget of {fmt_eur(budget)} EUR for {project}"
    else:
        decided = f"The committee decided to {decision}."
        outcome = f"decided to {decision}"
    act = rng.choice((f"Action: {owner} will {action} by {_doc_date(rng, deadline)}.",
                      f"{owner} agreed to {action} by {_doc_date(rng, deadline)}."))
    facts = [header, when, people, decided, act]
    fields = {"document_type": "meeting minutes", "date": held.isoformat(), "parties": attendees,
              "amount_eur": budget, "deadline": deadline.isoformat()}
    summary = (f"On {fmt_date(held)} the {committee} of {org} {outcome}; {owner} will {action} by "
               f"{fmt_date(deadline)}.")
    said = [("date", fmt_date(held)), ("other", committee), ("name", org),
            *([("amount", fmt_eur(budget)), ("other", project)] if budget is not None else [("other", decision)]),
            ("name", owner), ("other", action), ("date", fmt_date(deadline))]
    return f"minutes-{committee.split()[0].lower()}", facts, fields, summary, said


def _incident(rng: random.Random):
    reporter, owner = _people(rng, 2)
    ref = f"IR-{rng.randrange(100, 999)}"
    happened = _date(rng)
    site = f"{rng.choice(CITIES)} {rng.choice(SITES)}"
    incident = rng.choice(INCIDENTS)
    hours = rng.randint(1, 48)
    cost = _amount(rng, 500, 120000, 100)
    follow = rng.choice(FOLLOW_UPS)
    deadline = happened + timedelta(days=rng.randint(2, 30))
    header = rng.choice((f"INCIDENT REPORT {ref}", f"Incident report {ref}", f"Incident {ref}"))
    meta = rng.choice((f"Site: {site}\nDate of incident: {_doc_date(rng, happened)}\nReported by: {reporter}",
                       f"Reported by {reporter} on {_doc_date(rng, happened)} at the {site}."))
    what = (f"A {incident} at the {site} stopped work for {hours} hours. "
            f"The estimated cost is {fmt_eur(cost)} EUR.")
    nxt = rng.choice((f"Follow-up: {owner} will {follow} by {_doc_date(rng, deadline)}.",
                      f"{owner} is responsible to {follow} by {_doc_date(rng, deadline)}."))
    facts = [header, meta, what, nxt]
    fields = {"document_type": "incident report", "date": happened.isoformat(), "parties": [reporter, owner],
              "amount_eur": cost, "deadline": deadline.isoformat()}
    summary = (f"A {incident} at the {site} on {fmt_date(happened)} stopped work for {hours} hours and cost "
               f"{fmt_eur(cost)} EUR; {owner} will {follow} by {fmt_date(deadline)}.")
    said = [("other", incident), ("other", site), ("date", fmt_date(happened)), ("other", f"{hours} hours"),
            ("amount", fmt_eur(cost)), ("name", owner), ("other", follow), ("date", fmt_date(deadline))]
    return f"incident-{ref.lower()}", facts, fields, summary, said


def _purchase_order(rng: random.Random):
    buyer, supplier = _companies(rng, 2)
    number = f"PO-{rng.randrange(10000, 99999)}"
    ordered = _date(rng)
    deliver = ordered + timedelta(days=rng.randint(5, 60))
    item, lo, hi = rng.choice(ITEMS)
    qty = rng.randint(2, 200)
    unit = _amount(rng, lo, hi)
    total = qty * unit
    header = rng.choice((f"PURCHASE ORDER {number}", f"Purchase order {number}", f"Order {number}"))
    who = rng.choice((f"Buyer: {buyer}\nSupplier: {supplier}", f"{buyer} orders from {supplier}:"))
    when = rng.choice((f"Order date: {_doc_date(rng, ordered)}", f"Ordered on {_doc_date(rng, ordered)}."))
    what = f"{qty} {item} at {fmt_eur(unit)} EUR each. Total: {fmt_eur(total)} EUR."
    by = rng.choice((f"Deliver by {_doc_date(rng, deliver)} to {_address(rng)}.",
                     f"Delivery date: {_doc_date(rng, deliver)}"))
    facts = [header, when, who, what, by] if rng.random() < 0.5 else [header, who, when, what, by]
    fields = {"document_type": "purchase order", "date": ordered.isoformat(), "parties": [buyer, supplier],
              "amount_eur": total, "deadline": deliver.isoformat()}
    summary = (f"{buyer} ordered {qty} {item} from {supplier} for {fmt_eur(total)} EUR, to be delivered by "
               f"{fmt_date(deliver)}.")
    said = [("name", buyer), ("other", f"{qty} {item}"), ("name", supplier), ("amount", fmt_eur(total)),
            ("date", fmt_date(deliver))]
    return f"purchase-order-{number.lower()}", facts, fields, summary, said


BUILDERS = {"invoice": _invoice, "lease agreement": _lease, "meeting minutes": _minutes,
            "incident report": _incident, "purchase order": _purchase_order}


def _wrap(paragraph: str, width: int) -> str:
    return "\n".join(line for part in paragraph.split("\n") for line in textwrap.wrap(part, width) or [""])


def make_document(seed: int, *, kind: str | None = None, long: bool | None = None,
                  wrap: bool | None = None, filler: bool = True) -> Document:
    """The document of `seed`. kind, long and wrap are drawn from the seed unless given.

    long: the facts, then an operations log of 16-28 lines and some notes. Short documents put 0-5 filler
    sentences around the facts; filler=False leaves them out (the short first phase of training).
    """
    rng = random.Random(seed)
    kind = kind if kind is not None else rng.choice(KINDS)
    if kind not in BUILDERS:
        raise ValueError(f"unknown document kind {kind!r}; kinds are {KINDS}")
    long = long if long is not None else rng.random() < 0.3
    wrap = wrap if wrap is not None else rng.random() < 0.35
    markdown = not wrap and rng.random() < 0.15
    title, facts, fields, summary, said = BUILDERS[kind](rng)
    header, body = facts[0], facts[1:]
    if markdown:
        header = f"# {header}"
    if long:
        notes = _log(rng, rng.randint(16, 28))
        before = [header, *body]
        after = ["Operations log\n" + "\n".join(notes), *_paragraphs(_filler(rng, rng.randint(2, 5)), rng)]
    else:
        lead = _filler(rng, rng.randint(0, 2))
        tail = _filler(rng, rng.randint(0, 3))
        if not filler:
            lead, tail = [], []
        before = [header, *([" ".join(lead)] if lead else []), *body]
        after = [" ".join(tail)] if tail else []
    if wrap:
        width = rng.randint(60, 95)
        before = [_wrap(p, width) for p in before]
        after = [_wrap(p, width) for p in after]
    sep = "\n" if wrap else "\n\n"
    head_text = sep.join(before)
    # text from a PDF comes stripped, a text file ends with a newline
    text = head_text + (sep + sep.join(after) if after else "") + ("" if wrap else "\n")
    return Document(seed=seed, kind=kind, text=text, title=title, fields=fields, summary=summary,
                    facts_end=len(head_text), summary_facts=said,
                    extra={"long": long, "wrap": wrap, "markdown": markdown})


def held_out(n: int, *, start: int = 0) -> list[Document]:
    """The first n held-out evaluation documents (never drawn for training)."""
    return [make_document(HELD_OUT_SEEDS[start + i]) for i in range(n)]


def held_out_long(n: int) -> list[Document]:
    """The first n long held-out documents (facts, then more than a window of log), in held-out order: the long
    ones among `held_out(m)` for the smallest m that has n of them."""
    out = []
    for seed in HELD_OUT_SEEDS:
        if len(out) == n:
            return out
        doc = make_document(seed)
        if doc.extra["long"]:
            out.append(doc)
    raise ValueError(f"the held-out range has fewer than {n} long documents")


def long_copy_drill(seed: int) -> tuple[str, str]:
    """(a list of 1-3 random names, companies, amounts and dates; the list followed by an operations log of 28-40
    lines): the drill "repeat the list" with the list more than a window of tokens before the question, so only
    the carried GDN state can answer it (the long documents' problem without the document's phrasing)."""
    rng = random.Random(seed)
    items = [_drill_item(rng) for _ in range(rng.randint(1, 3))]
    listed = ", ".join(items)
    return listed, listed + "\n\nOperations log\n" + "\n".join(_log(rng, rng.randint(28, 40)))


def _drill_item(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return _person(rng)
    if r < 0.6:
        return _company(rng)
    if r < 0.8:
        return fmt_eur(_amount(rng, 10, 200_000))
    return _doc_date(rng, _date(rng))


def copy_drill(seed: int) -> str:
    """A list of 6-14 random names, companies, amounts and dates, for the training drill "repeat the list".

    Nothing in it can be guessed from the rest, so the only way to repeat it is to copy: the drill gives the
    model the copying that extraction and summaries need (a name, an amount, a date out of the document)
    without the document's phrasing to learn first.
    """
    rng = random.Random(seed)
    return ", ".join(_drill_item(rng) for _ in range(rng.randint(6, 14)))
