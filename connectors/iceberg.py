"""The Iceberg sink (`output.format: iceberg`): result rows upserted on `doc_id` into an Iceberg table, one snapshot
per committed batch, through pyiceberg.

Notable choices:
- The driver commits, alone, under the output's lock (jobs/runner.py): the workers hand their result rows back
  (a few KB per document) instead of committing them. Iceberg commits are optimistic: several write tasks
  committing to one table would each redo their commit whenever another landed first, and a commit could not be
  fenced by the lock the way a Parquet part is (connectors/sink.py). One writer has no conflicts of its own; a
  commit that still conflicts (another writer of the table, a compaction) is retried against the refreshed table
  (`COMMIT_ATTEMPTS`).
- Not Ray's `Dataset.write_iceberg(mode=UPSERT)`: it writes the data files in the workers and commits once when the
  whole dataset is written, so a run killed near its end loses everything, and each upsert there is pyiceberg's
  `Table.upsert` (a delete snapshot, then an append: two or three snapshots per commit).
- One snapshot per commit: the batch's rows are added as data files (a fast append), and when some of its
  documents have an older row (a retried failure, a changed text) the data files holding those rows are replaced,
  in the same snapshot, by their other rows (an overwrite snapshot). Which documents have an older row is known
  from the plan, read from the table's current snapshot under the lock (`replaced`), so a batch of new documents
  never scans the table. A kill before the catalog's commit leaves the table at its last snapshot (the data files
  already written are orphans that no snapshot references; `compact_table` removes them); a re-run reads the table
  as that snapshot has it and runs the rest: exactly one row per doc_id. How often the driver commits:
  pipeline/table_stages.py IcebergCommitter.
- pyiceberg's commit copies the table's metadata, every snapshot included, several times: a commit costs more as
  snapshots accumulate (bench/sinks.py), hence commits by time and `compact_table` between runs.
- The default catalog is a SQL catalog named `default` on SQLite at `<output.uri>/catalog.db`, warehouse
  `<output.uri>/warehouse` (local output folders only: SQLite needs a local file). A SQL catalog keeps each catalog
  name's tables apart, so readers load it as `load_catalog("default", type="sql", uri=..., warehouse=...)`.
- The table is created from the pipeline's output schema; columns that a later version adds are added to the table
  (`union_by_name`), so an older table keeps working.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from clover_batch.connectors.faults import fault_point
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import INDEX_SCHEMA

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

CATALOG_NAME = "default"  # the catalog's name unless output.catalog gives `name` (pyiceberg's own default)
CATALOG_FILE = "catalog.db"
WAREHOUSE_DIR = "warehouse"
TABLE_FILE = "_iceberg.json"  # in output.uri: which table holds the rows, for `clover-batch show`
COMMIT_ATTEMPTS = 5  # commits that conflict with another writer are redone on the refreshed table this many times
RUN_ID_PROPERTY = "clover-batch.run-id"  # in each snapshot's summary: the run that committed it
# a snapshot per batch makes a metadata file per batch: keep the last ones only (the snapshots themselves stay
# until expired, see compact_table). No retries inside pyiceberg: it would re-apply a fast append on top of another
# writer's commit without looking for that writer's rows of the same documents; `commit_rows` redoes the whole upsert.
TABLE_PROPERTIES = {"write.metadata.delete-after-commit.enabled": "true", "write.metadata.previous-versions-max": "20",
                    "commit.retry.num-retries": "0"}
SECRET_WORDS = ("secret", "key", "token", "password", "credential", "session")


class IcebergOutputError(ValueError):
    """The Iceberg output cannot be used as configured (no catalog for a remote output folder, ...)."""


@dataclass(frozen=True)
class IcebergTarget:
    """The table that receives the rows, and the catalog that holds it (plain values: it travels to Ray)."""

    output: Location  # output.uri: the lock, the manifest, the reports (and the default catalog)
    table: str  # namespace.name
    catalog: dict[str, Any] = field(default_factory=dict)  # pyiceberg properties; empty: the embedded default

    def catalog_properties(self) -> dict[str, Any]:
        if self.catalog:
            return dict(self.catalog)
        fs, root = self.output.filesystem()
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            raise IcebergOutputError(f"output.catalog is empty and output.uri {self.output.uri} is not a local "
                                     f"folder: the default catalog is a SQLite file there. Give output.catalog "
                                     f"(rest, glue, hive, or sql with a database uri)")
        root = root.rstrip("/")
        return {"type": "sql", "uri": f"sqlite:///{posixpath.join(root, CATALOG_FILE)}",
                "warehouse": f"file://{posixpath.join(root, WAREHOUSE_DIR)}"}

    def load_catalog(self) -> Catalog:
        from pyiceberg.catalog import load_catalog

        props = self.catalog_properties()
        if props.get("type") == "sql" and str(props.get("uri", "")).startswith("sqlite:///"):
            os.makedirs(posixpath.dirname(props["uri"].removeprefix("sqlite:///")), exist_ok=True)
        # a SQL catalog keeps the tables of each catalog name apart: readers must load it by the same name
        return load_catalog(props.pop("name", CATALOG_NAME), **props)

    def load(self, schema: pa.Schema | None = None) -> Table | None:
        """The table; created (with its namespace) from `schema` when absent and a schema is given."""
        from pyiceberg.exceptions import NoSuchTableError

        catalog = self.load_catalog()
        namespace = self.table.rsplit(".", 1)[0]
        try:
            table = catalog.load_table(self.table)
        except NoSuchTableError:
            if schema is None:
                return None
            catalog.create_namespace_if_not_exists(namespace)
            table = catalog.create_table_if_not_exists(self.table, schema=schema, properties=TABLE_PROPERTIES)
            log.info("created Iceberg table %s", self.table)
        if schema is not None and any(table.properties.get(k) != v for k, v in TABLE_PROPERTIES.items()):
            with table.transaction() as txn:  # a table made elsewhere: commits as this module expects them
                txn.set_properties(TABLE_PROPERTIES)
            table = table.refresh()
        if schema is not None:
            missing = [n for n in schema.names if n not in {f.name for f in table.schema().fields}]
            if missing:
                with table.update_schema() as update:
                    update.union_by_name(schema)
                log.info("added columns %s to Iceberg table %s", missing, self.table)
        return table

    def describe(self) -> dict[str, Any]:
        """What `_iceberg.json` records: the table and the catalog, credentials left out."""
        return {"table": self.table,
                "catalog": {k: v for k, v in self.catalog.items() if not any(w in k.lower() for w in SECRET_WORDS)}}


def write_description(target: IcebergTarget) -> None:
    fs, root = target.output.filesystem()
    path = posixpath.join(root.rstrip("/"), TABLE_FILE)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        os.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, json.dumps(target.describe(), indent=2, sort_keys=True).encode())


def read_description(output: Location, catalog: dict[str, Any] | None = None) -> IcebergTarget | None:
    """The Iceberg table an output folder's runs write to, or None for a Parquet output. `catalog` adds the
    properties left out of `_iceberg.json` (credentials)."""
    fs, root = output.filesystem()
    try:
        described = json.loads(fs.cat_file(posixpath.join(root.rstrip("/"), TABLE_FILE)))
    except FileNotFoundError:
        return None
    return IcebergTarget(output, described["table"], {**described.get("catalog", {}), **(catalog or {})})


def read_table_index(target: IcebergTarget) -> pa.Table:
    """doc_id, status, version of every row of the table (INDEX_SCHEMA; `part` is empty)."""
    table = target.load()
    if table is None or table.current_snapshot() is None:
        return INDEX_SCHEMA.empty_table()
    rows = table.scan(selected_fields=("doc_id", "status", "version")).to_arrow()
    parts = pa.array([""] * rows.num_rows, pa.string())
    return pa.table([rows.column("doc_id"), rows.column("status"), parts, rows.column("version")],
                    names=["doc_id", "status", "part", "version"]).cast(INDEX_SCHEMA)


def read_table_rows(target: IcebergTarget, columns: list[str] | None = None) -> pa.Table | None:
    """All rows of the table (the current snapshot), or None when it has none."""
    table = target.load()
    if table is None or table.current_snapshot() is None:
        return None
    scan = table.scan(selected_fields=tuple(columns)) if columns else table.scan()
    return scan.to_arrow()


def _commit_once(table: Table, rows: pa.Table, replaced: list[str], run_id: str) -> Table:
    """Stage one snapshot: `rows` added, and the older rows of `replaced` documents removed (their data files
    replaced by their other rows); commit it. With nothing to remove it is a fast append, which neither reads nor
    rewrites the existing manifests: a batch of new documents costs the same on a large table as on an empty one."""
    from pyiceberg.expressions import AlwaysTrue, In
    from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files

    txn = table.transaction()
    metadata = txn.table_metadata  # a deep copy per access in pyiceberg: taken once
    counter = itertools.count(0)
    rewrites = []  # (data file to drop, its rows to keep)
    if replaced and table.current_snapshot() is not None:
        drop = pa.array(replaced, pa.string())
        for task in table.scan(row_filter=In("doc_id", set(replaced))).plan_files():
            old = ArrowScan(table_metadata=metadata, io=table.io, projected_schema=metadata.schema(),
                            row_filter=AlwaysTrue()).to_table(tasks=[task])
            keep = old.filter(pc.invert(pc.is_in(old.column("doc_id"), value_set=drop)))
            if keep.num_rows < old.num_rows:  # else the file's statistics matched, none of its rows does
                rewrites.append((task.file, keep))
    update = txn.update_snapshot(snapshot_properties={RUN_ID_PROPERTY: run_id})
    with (update.overwrite() if rewrites else update.fast_append()) as snapshot:
        for data_file, keep in rewrites:
            snapshot.delete_data_file(data_file)
            if keep.num_rows:
                for new_file in _dataframe_to_data_files(table_metadata=metadata, df=keep, io=table.io,
                                                         write_uuid=snapshot.commit_uuid, counter=counter):
                    snapshot.append_data_file(new_file)
        for new_file in _dataframe_to_data_files(table_metadata=metadata, df=rows, io=table.io,
                                                 write_uuid=snapshot.commit_uuid, counter=counter):
            snapshot.append_data_file(new_file)
    fault_point("iceberg_writing")  # the data files are written, the catalog does not reference them yet
    return txn.commit_transaction()  # the table as committed: no second read of the catalog


def commit_rows(target: IcebergTarget, table: Table, rows: pa.Table, replaced: list[str], run_id: str,
                check: Any = None) -> Table:
    """Upsert `rows` (the output schema) as one snapshot; `replaced`: their doc_ids that already have a row.
    `check()` runs right before each commit attempt (the output lock's fencing check). Returns the table as
    committed.

    A commit that conflicts with another writer (CommitFailedException: the table moved past the snapshot this one
    was built on; pyiceberg's own retries are off, TABLE_PROPERTIES) is redone on the refreshed table. A document of
    `rows` that the plan did not know as `replaced` may have been written meanwhile by that other writer, so each
    redo looks for older rows of all of the batch's documents."""
    from pyiceberg.exceptions import CommitFailedException, ValidationException

    ids = rows.column("doc_id").to_pylist()
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        if check is not None:
            check()
        try:
            table = _commit_once(table, rows, replaced, run_id)
            break
        except (CommitFailedException, ValidationException) as e:
            if attempt == COMMIT_ATTEMPTS:
                raise
            log.warning("Iceberg commit to %s conflicted (%s); redoing it on the refreshed table (attempt %d)",
                        target.table, e, attempt + 1)
            time.sleep(0.1 * attempt)
            table = table.refresh()
            replaced = ids
    fault_point("iceberg_committed")
    return table


def table_stats(target: IcebergTarget) -> dict[str, int]:
    """Snapshots, data files and rows of the table's current state (bench/sinks.py, docs/tables.md: maintenance)."""
    table = target.load()
    if table is None or table.current_snapshot() is None:
        return {"snapshots": 0, "data_files": 0, "rows": 0}
    files = list(table.scan().plan_files())
    return {"snapshots": len(table.snapshots()), "data_files": len(files),
            "rows": sum(t.file.record_count for t in files)}


def compact_table(target: IcebergTarget, remove_files: bool = True) -> dict[str, int]:
    """Rewrite the table's live rows as few data files, expire every older snapshot, and (the embedded local
    warehouse only, `remove_files`) delete the data files no snapshot references any more: those of expired
    snapshots and those a killed run wrote but never committed. Takes the output's lock, so no run writes
    meanwhile. Time travel to the expired snapshots is gone. Returns table_stats after it."""
    from clover_batch.connectors.sink import OutputLock

    with OutputLock(target.output, f"compact-{int(time.time())}"):
        table = target.load()
        if table is None or table.current_snapshot() is None:
            return table_stats(target)
        table.overwrite(table.scan().to_arrow())  # one delete and one append snapshot: the live rows, bin-packed
        table = table.refresh()
        current = table.current_snapshot().snapshot_id
        old = [s.snapshot_id for s in table.snapshots() if s.snapshot_id != current]
        if old:
            table.maintenance.expire_snapshots().by_ids(old).commit()
        if remove_files and not target.catalog:
            live = {t.file.file_path.removeprefix("file://") for t in table.refresh().scan().plan_files()}
            data = os.path.join(table.location().removeprefix("file://"), "data")
            for folder, _, names in os.walk(data):
                for name in names:
                    path = os.path.join(folder, name)
                    if name.endswith(".parquet") and path not in live:
                        os.remove(path)
    return table_stats(target)
