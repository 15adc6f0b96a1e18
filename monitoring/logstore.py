"""Logs on Parquet: datasets of rows partitioned by tenant, model and hour, on the configured
storage (a directory on local disk, or a prefix of the artifacts' S3 bucket), read with DuckDB.

A dataset is a name ("predictions"; others may be registered) and a base schema. Every table
written to one has ``tenant_id``, ``model_id`` and ``created_at`` (timestamp, UTC) columns; the
store splits it by partition and writes one file per partition::

    <base>/<dataset>/tenant=<id>/model=<id>/hour=YYYY-MM-DDTHH/<unique>.parquet

Hive-style names, so Spark, Trino and DuckDB itself see ``tenant``, ``model`` and ``hour`` as
partition columns (docs/operations.md). Only ids ever go into a path; everything a caller names
freely (features, outputs) is a column.

Why this shape: a reader lists exactly the partitions of one tenant (and model, and hour range)
by path, so tenant isolation and pruning are the same thing, and retention drops whole
directories instead of deleting rows. A file appears whole or not at all: on local disk it is
written under a hidden temporary name and renamed; an S3 PUT is atomic. Files of one partition
may differ in columns (a new version adds a feature): readers union them by name.

Compaction merges a closed hour's small files into one. The merged file names the files it
replaces in its Parquet metadata, and a listing that sees both leaves the replaced ones out, so a
reader between the merge and the deletes counts no row twice.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from django.conf import settings

if TYPE_CHECKING:
    import duckdb

HOUR = timedelta(hours=1)
HOUR_FORMAT = "%Y-%m-%dT%H"
COMPACTED = "compact-"  # the name prefix of a compaction's output
REPLACES_KEY = b"switchyard.replaces"  # in a compacted file's metadata: the files it merged
# Up to this many hours a listing asks for each hour's directory; past it, one recursive
# listing of the model's prefix (one request per 1,000 files on S3) is cheaper.
PER_HOUR_LISTING_MAX = 48
COMPRESSION = "zstd"
# DuckDB's threads per query: a page's query should not take every core of a web process.
QUERY_THREADS = 2

# Dataset name → base schema: the columns every file of the dataset has (more may follow).
_DATASETS: dict[str, pa.Schema] = {}


def register_dataset(name: str, schema: pa.Schema) -> None:
    """Declare a dataset and its base schema (what a query over no file at all returns). The
    schema must hold ``tenant_id`` and ``model_id`` (integers) and ``created_at`` (timestamp)."""
    missing = {"tenant_id", "model_id", "created_at"} - set(schema.names)
    if missing:
        raise ValueError(f"dataset {name!r} lacks the partition columns {sorted(missing)}")
    _DATASETS[name] = schema


def base_schema(dataset: str) -> pa.Schema:
    return _DATASETS[dataset]


def quote(identifier: str) -> str:
    """A column name as a SQL identifier, whatever it holds (quotes, dots, unicode)."""
    return '"' + identifier.replace('"', '""') + '"'


def hour_of(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Partition:
    tenant_id: int
    model_id: int
    hour: datetime  # the hour's start, UTC


@dataclass(frozen=True)
class Piece:
    """One file to write: a partition's rows under the path they will have."""

    path: str
    table: pa.Table
    partition: Partition


class LogStore:
    """The log datasets on one filesystem under one base path."""

    def __init__(self, filesystem: pafs.FileSystem, base: str) -> None:
        self.fs = filesystem
        self.base = base.rstrip("/")
        self.local = isinstance(filesystem, pafs.LocalFileSystem)

    # Paths ------------------------------------------------------------------------------------

    def partition_dir(self, dataset: str, p: Partition) -> str:
        return (
            f"{self.model_dir(dataset, p.tenant_id, p.model_id)}/"
            f"hour={p.hour.strftime(HOUR_FORMAT)}"
        )

    def tenant_dir(self, dataset: str, tenant_id: int) -> str:
        if dataset not in _DATASETS:
            raise KeyError(f"unknown log dataset {dataset!r}")
        return f"{self.base}/{dataset}/tenant={int(tenant_id)}"

    def model_dir(self, dataset: str, tenant_id: int, model_id: int) -> str:
        return f"{self.tenant_dir(dataset, tenant_id)}/model={int(model_id)}"

    # Writing ----------------------------------------------------------------------------------

    def split(self, dataset: str, table: pa.Table, name: str | None = None) -> list[Piece]:
        """The table as one piece per partition, each with a fresh unique file name (or
        ``name``, for a writer that must give the same rows the same name on every run): a
        writer that must retry a piece writes it again under the same name, so a retry after a
        write that did land (its answer lost) replaces the file instead of adding its rows
        twice."""
        if table.num_rows == 0:
            return []
        micros = pc.cast(table["created_at"], pa.timestamp("us", tz="UTC")).cast(pa.int64())
        keys = np.column_stack(
            [
                table["tenant_id"].to_numpy().astype(np.int64),
                table["model_id"].to_numpy().astype(np.int64),
                micros.to_numpy() // 3_600_000_000,
            ]
        )
        unique, inverse = np.unique(keys, axis=0, return_inverse=True)
        pieces = []
        for i, (tenant_id, model_id, hour) in enumerate(unique):
            part = table if len(unique) == 1 else table.take(np.flatnonzero(inverse == i))
            p = Partition(
                int(tenant_id), int(model_id), datetime.fromtimestamp(int(hour) * 3600, UTC)
            )
            file = name or _file_name()
            pieces.append(Piece(f"{self.partition_dir(dataset, p)}/{file}", part, p))
        return pieces

    def put(self, piece: Piece, metadata: dict[bytes, bytes] | None = None) -> None:
        """Write one piece whole: readers see the file complete or not at all."""
        table = piece.table
        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        if not self.local:
            pq.write_table(table, piece.path, filesystem=self.fs, compression=COMPRESSION)
            return
        folder, name = piece.path.rsplit("/", 1)
        self.fs.create_dir(folder, recursive=True)
        temporary = f"{folder}/.{name}.tmp"  # hidden: no listing (ours, Spark's) takes it
        try:
            pq.write_table(table, temporary, filesystem=self.fs, compression=COMPRESSION)
            self.fs.move(temporary, piece.path)
        except BaseException:
            _delete_quietly(self.fs, temporary)
            raise

    def write(self, dataset: str, table: pa.Table) -> list[str]:
        """Write the table, one file per partition; returns the paths written."""
        pieces = self.split(dataset, table)
        for piece in pieces:
            self.put(piece)
        return [piece.path for piece in pieces]

    # Listing ----------------------------------------------------------------------------------

    def tenants(self, dataset: str) -> list[int]:
        return _ids(self._dirs(f"{self.base}/{dataset}"), "tenant")

    def models(self, dataset: str, tenant_id: int) -> list[int]:
        return _ids(self._dirs(self.tenant_dir(dataset, tenant_id)), "model")

    def hours(self, dataset: str, tenant_id: int, model_id: int) -> list[datetime]:
        """The hours (starts, UTC) that hold files of one model, oldest first."""
        found = []
        for path in self._dirs(self.model_dir(dataset, tenant_id, model_id)):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("hour="):
                try:
                    found.append(datetime.strptime(name[5:], HOUR_FORMAT).replace(tzinfo=UTC))
                except ValueError:
                    continue  # not ours
        return sorted(found)

    def files(
        self,
        dataset: str,
        tenant_id: int,
        model_ids: Sequence[int] | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[str]:
        """The files of one tenant's models (all of them when None) whose hours meet
        [start, end]: pruned by path, so nothing outside the tenant is ever listed."""
        if model_ids is None:
            model_ids = self.models(dataset, tenant_id)
        first = hour_of(start) if start is not None else None
        last = hour_of(end) if end is not None else None
        found: list[str] = []
        for model_id in model_ids:
            model = self.model_dir(dataset, tenant_id, model_id)
            if first is not None and last is not None:
                span = (last - first) // HOUR + 1
                if 0 < span <= PER_HOUR_LISTING_MAX:
                    for i in range(span):
                        hour = first + i * HOUR
                        found += self._partition_files(f"{model}/hour={hour:{HOUR_FORMAT}}")
                    continue
            for hour in self.hours(dataset, tenant_id, model_id):
                if (first is None or hour >= first) and (last is None or hour <= last):
                    found += self._partition_files(f"{model}/hour={hour.strftime(HOUR_FORMAT)}")
        return found

    def _dirs(self, path: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return [i.path for i in infos if i.type == pafs.FileType.Directory]

    def _partition_files(self, folder: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
        names = sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and i.path.endswith(".parquet")
            and not i.base_name.startswith((".", "_"))
        )
        compacted = [n for n in names if n.rsplit("/", 1)[-1].startswith(COMPACTED)]
        if not compacted or len(names) == len(compacted):
            return names
        # A compaction under way (or one whose deletes failed): its output already holds the
        # rows of the files it names, which must not be read twice.
        replaced: set[str] = set()
        for path in compacted:
            meta = pq.read_metadata(path, filesystem=self.fs).metadata or {}
            replaced.update(meta.get(REPLACES_KEY, b"").decode().split("\n"))
        return [n for n in names if n.rsplit("/", 1)[-1] not in replaced]

    # Reading ----------------------------------------------------------------------------------

    @contextmanager
    def connect(self, dataset: str, files: Sequence[str]) -> Iterator[duckdb.DuckDBPyConnection]:
        """A DuckDB connection with the view ``log`` over exactly these files (their columns
        unioned by name; the dataset's base schema, empty, when there is no file). Tables of a
        caller's own (labels, ids) join it through ``view``."""
        # A cursor of one in-memory database per process, not a database per query: opening
        # one costs ~20 ms, a cursor (with views of its own) microseconds.
        con = _database().cursor()
        try:
            if not files:
                view(con, "log", base_schema(dataset).empty_table())
            elif self.local:
                listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
                con.execute(
                    f"CREATE TEMP VIEW log AS SELECT * FROM read_parquet([{listing}], "
                    "union_by_name = true)"
                )
            else:
                # No httpfs extension to download on closed networks: DuckDB scans a pyarrow
                # dataset over S3 instead (projection and filters pushed down to it).
                schemas = [pq.read_schema(f, filesystem=self.fs) for f in files]
                schema = pa.unify_schemas(schemas, promote_options="permissive")
                dataset_ = pads.dataset(
                    list(files), schema=schema, format="parquet", filesystem=self.fs
                )
                view(con, "log", dataset_)
            yield con
        finally:
            con.close()

    def query(
        self, dataset: str, files: Sequence[str], sql: str, params: Sequence[Any] = ()
    ) -> pa.Table:
        """Run one statement over the view ``log`` of these files; its rows as Arrow."""
        with self.connect(dataset, files) as con:
            return con.sql(sql, params=list(params) or None).to_arrow_table()

    def row_count(self, files: Sequence[str]) -> int:
        """Rows in these files, from their footers only."""
        return sum(pq.read_metadata(f, filesystem=self.fs).num_rows for f in files)

    # Retention and compaction -----------------------------------------------------------------

    def drop_before(self, dataset: str, tenant_id: int, model_id: int, cutoff: datetime) -> int:
        """Delete the model's hour partitions that end at or before ``cutoff`` (every row in
        them is older); returns how many were dropped."""
        dropped = 0
        for hour in self.hours(dataset, tenant_id, model_id):
            if hour + HOUR <= cutoff:
                p = Partition(tenant_id, model_id, hour)
                self.fs.delete_dir(self.partition_dir(dataset, p))
                dropped += 1
        return dropped

    def compact(self, dataset: str, p: Partition) -> int:
        """Merge a partition's files into one; returns how many files were merged (0 when
        there was nothing to merge). Call it on closed hours only: a file written meanwhile
        is simply left for the next run."""
        folder = self.partition_dir(dataset, p)
        files = self._partition_files(folder)
        if len(files) < 2:
            return 0
        tables = [pq.read_table(f, filesystem=self.fs) for f in files]
        merged = pa.concat_tables(
            [t.replace_schema_metadata(None) for t in tables], promote_options="permissive"
        )
        merged = merged.sort_by("created_at")
        names = "\n".join(f.rsplit("/", 1)[-1] for f in files)
        piece = Piece(f"{folder}/{COMPACTED}{_file_name()}", merged, p)
        self.put(piece, {REPLACES_KEY: names.encode()})
        for f in files:
            self._delete(f)
        return len(files)

    def _delete(self, path: str) -> None:
        self.fs.delete_file(path)


def view_columns(con: duckdb.DuckDBPyConnection, name: str = "log") -> list[str]:
    """The column names of a view of ``LogStore.connect`` (its files' union)."""
    return [row[0] for row in con.execute(f"DESCRIBE {quote(name)}").fetchall()]


def view(con: duckdb.DuckDBPyConnection, name: str, data: Any) -> None:
    """An Arrow table (or dataset) as a view of this connection only (``register`` costs
    ~70 ms a call in this DuckDB; this well under one)."""
    con.from_arrow(data).create_view(name, replace=True)


_db: duckdb.DuckDBPyConnection | None = None
_db_lock = threading.Lock()


def _database() -> duckdb.DuckDBPyConnection:
    global _db
    if _db is None:
        # Imported here: it costs ~0.25 s, which every Django process (the gateway's, a
        # manage.py command) would pay at start though only the log's readers use it.
        import duckdb

        with _db_lock:
            if _db is None:
                db = duckdb.connect(config={"threads": QUERY_THREADS})
                _in_utc(db)
                _db = db
    return _db


def scalar(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] = ()) -> Any:
    """The one value a statement answers (None for no row)."""
    rows = con.execute(sql, list(params)).fetchall()
    return rows[0][0] if rows else None


def _in_utc(con: duckdb.DuckDBPyConnection) -> None:
    """Hours and days cut (date_trunc) in UTC, as the partitions are. Without the ICU
    extension (not downloadable on closed networks) DuckDB's time zone is UTC already."""
    import duckdb

    try:
        con.execute("SET GLOBAL TimeZone = 'UTC'")
    except duckdb.Error:
        pass


def _file_name() -> str:
    at = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{at}-{os.getpid()}-{uuid.uuid4().hex[:16]}.parquet"


def _ids(paths: list[str], key: str) -> list[int]:
    found = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if name.startswith(f"{key}=") and name[len(key) + 1 :].isdigit():
            found.append(int(name[len(key) + 1 :]))
    return sorted(found)


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except OSError:
        pass


# The configured store -------------------------------------------------------------------------

_stores: dict[tuple[Any, ...], LogStore] = {}
_stores_lock = threading.Lock()


def store_settings() -> tuple[Any, ...]:
    """What the configured store depends on (settings may change in tests)."""
    options = settings.STORAGES["default"].get("OPTIONS", {})
    return (
        settings.SWITCHYARD_STORAGE,
        settings.SWITCHYARD_LOG_ROOT,
        str(settings.MEDIA_ROOT),
        options.get("bucket_name"),
        options.get("endpoint_url"),
        options.get("region_name"),
    )


def log_store() -> LogStore:
    """The store the settings name: a directory (``SWITCHYARD_LOG_ROOT``, by default
    MEDIA_ROOT/logs) on the embedded default, or the artifacts' S3 bucket under the prefix
    ``SWITCHYARD_LOG_ROOT`` (by default ``logs``) with SWITCHYARD_STORAGE=s3."""
    key = store_settings()
    store = _stores.get(key)
    if store is None:
        with _stores_lock:
            store = _stores.get(key) or _make_store()
            _stores[key] = store
    return store


def _make_store() -> LogStore:
    root = settings.SWITCHYARD_LOG_ROOT
    if settings.SWITCHYARD_STORAGE != "s3":
        path = os.path.abspath(root or os.path.join(settings.MEDIA_ROOT, "logs"))
        return LogStore(pafs.LocalFileSystem(), path.replace(os.sep, "/"))
    options = settings.STORAGES["default"]["OPTIONS"]
    endpoint = options.get("endpoint_url")
    kwargs: dict[str, Any] = {
        "region": options.get("region_name") or None,
        # A storage that stops answering fails the write within the timeouts (the read
        # timeout is the AWS SDK's ~3 s on Linux, where pyarrow ignores request_timeout), and
        # is not retried inside the SDK: the writer keeps the batch, counts the retry and tries
        # again after its own backoff, so a stall shows in its metrics.
        "connect_timeout": settings.SWITCHYARD_LOG_S3_TIMEOUT_S,
        "request_timeout": settings.SWITCHYARD_LOG_S3_TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    }
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["scheme"] = parsed.scheme or "https"
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
    prefix = (root or "logs").strip("/")
    return LogStore(pafs.S3FileSystem(**kwargs), f"{options['bucket_name']}/{prefix}")
