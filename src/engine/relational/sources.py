"""Tables for SQL: SQLite files read with Python's ``sqlite3`` into Arrow and registered on a
DuckDB connection (DuckDB's own sqlite extension is downloaded at run time, so it is not used),
and the movies database that ``bokeh-sampledata`` ships.
"""

from __future__ import annotations

import os
import sqlite3

import pyarrow as pa

SQLITE_MAGIC = b"SQLite format 3\x00"


def movies_db_path() -> str:
    """``movies.db`` from the installed ``bokeh-sampledata`` package (tables ``omdb`` and
    ``tomatoes``, 17,472 films, joined on ``ID``)."""
    import importlib.util

    spec = importlib.util.find_spec("bokeh_sampledata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package bokeh-sampledata is not installed "
                                "(pip install bokeh-sampledata)")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "_data", "movies.db")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bokeh-sampledata is installed but {path} is missing")
    return path


def is_sqlite(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _arrow_type(declared: str) -> pa.DataType | None:
    """Arrow type for a column by SQLite's type-affinity rules (section 3.1 of its datatype
    doc); ``None``: let Arrow infer (BLOB / no affinity)."""
    t = declared.upper()
    if "INT" in t:
        return pa.int64()
    if "CHAR" in t or "CLOB" in t or "TEXT" in t:
        return pa.string()
    if "BLOB" in t or not t:
        return None
    if "REAL" in t or "FLOA" in t or "DOUB" in t:
        return pa.float64()
    return None  # NUMERIC affinity: integers and reals mixed; Arrow infers


def read_sqlite_table(con: sqlite3.Connection, table: str) -> pa.Table:
    """One SQLite table as Arrow, columns typed by their declared affinity. A value that does
    not fit its column's type (SQLite stores any value in any column) is an error naming the
    table and column."""
    cols = con.execute(f"PRAGMA table_info({_quote(table)})").fetchall()  # cid, name, type, ...
    rows = con.execute(f"SELECT * FROM {_quote(table)}").fetchall()
    arrays, names = [], []
    for i, (_, name, declared, *_rest) in enumerate(cols):
        values = [r[i] for r in rows]
        typ = _arrow_type(declared or "")
        try:
            arrays.append(pa.array(values, type=typ))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ValueError(f"sqlite table {table!r}, column {name!r} (declared "
                             f"{declared!r}): {e}") from e
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def register_sqlite(duck, path: str) -> list[str]:
    """Copy every table of the SQLite file ``path`` into a DuckDB table of the same name on
    the connection ``duck``. Returns the table names."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"db: no such file: {path}")
    src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = [r[0] for r in src.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name")]
        for name in names:
            tmp = "__kvstore_sqlite_import"
            duck.register(tmp, read_sqlite_table(src, name))
            try:
                duck.execute(f"CREATE TABLE {_quote(name)} AS SELECT * FROM {tmp}")
            finally:
                duck.unregister(tmp)
    finally:
        src.close()
    return names
