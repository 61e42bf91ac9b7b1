"""Checks of an LMDB data file before LMDB maps it.

LMDB maps ``data.mdb`` and trusts it: a page number beyond the end of a truncated file is a
SIGBUS that kills the interpreter, and the meta pages decide which pages it touches. So before
:class:`kvstore.format.catalog.Catalog` opens the environment, this module reads the two meta pages
with ordinary reads and checks what LMDB will rely on (the on-disk format of LMDB 0.9, 64-bit):

* the file holds at least the two meta pages, each flagged ``P_META`` with LMDB's magic and
  data version, and one page size (a power of two, 512 B .. 64 KiB);
* the meta LMDB will pick (the higher transaction id) has its last page inside the file and
  every database root at or below it, with a plausible tree depth;
* then (when asked) the walk of every page reachable from the roots (branch, leaf and
  overflow pages of the main and free databases and of every named database): each page
  must lie inside the used part of the file and carry the flags of its kind, its node
  offsets and sizes must lie inside the page, and overflow runs inside the file.

A file that fails any check is :class:`~kvstore.errors.CorruptData` naming it; LMDB never
sees it. The walk reads pages with ``pread``; the catalog is small (megabytes), and it runs
once per open.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from kvstore.errors import CorruptData

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
PAGEHDR = 16  # pgno u64, pad u16, flags u16, lower u16, upper u16 (or pages u32)
NODEHDR = 8  # lo u16, hi u16, flags u16, ksize u16 (then the key, then data or an overflow pgno)
DB_SIZE = 48  # pad u32, flags u16, depth u16, branch, leaf, overflow, entries, root (u64 each)
MAX_DEPTH = 32
MAX_PAGES = 1 << 22  # pages the walk visits at most (16 GiB of 4 KiB pages)

_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")
_TAIL = struct.Struct("<QQ")  # last_pg, txnid


class _Meta:
    def __init__(self, page: bytes, where: str) -> None:
        pgno, _, flags = struct.unpack_from("<QHH", page, 0)
        magic, version, _, self.mapsize = _META.unpack_from(page, PAGEHDR)
        if not flags & P_META or magic != MAGIC or version != DATA_VERSION:
            raise CorruptData(f"{where}: not an LMDB meta page (flags {flags:#x}, magic "
                              f"{magic:#x}, version {version})")
        off = PAGEHDR + _META.size
        self.dbs = [_DB.unpack_from(page, off), _DB.unpack_from(page, off + DB_SIZE)]
        self.psize = self.dbs[0][0]  # LMDB keeps the page size in the free DB's pad field
        self.last_pg, self.txnid = _TAIL.unpack_from(page, off + 2 * DB_SIZE)


def check_data_file(fd: int, shown: str, *, walk: bool) -> None:
    """Raise :class:`CorruptData` unless the LMDB data file open at ``fd`` is safe to map: the
    meta pages, and with ``walk`` every page reachable from them (only while no process can
    commit: pages a commit frees may be reused under the walk). An empty file (LMDB
    initializes it) passes."""
    size = os.fstat(fd).st_size
    if size == 0:
        return
    first = os.pread(fd, 4096, 0)
    if len(first) < PAGEHDR + _META.size + 2 * DB_SIZE + _TAIL.size:
        raise CorruptData(f"catalog file {shown!r} is truncated ({size} bytes)")
    m0 = _Meta(first, f"catalog file {shown!r}, meta page 0")
    psize = m0.psize
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise CorruptData(f"catalog file {shown!r} has an invalid page size {psize}")
    if size < 2 * psize:
        raise CorruptData(f"catalog file {shown!r} is truncated ({size} bytes, less than its "
                          f"two meta pages)")
    m1 = _Meta(os.pread(fd, psize, psize), f"catalog file {shown!r}, meta page 1")
    if m1.psize != psize:
        raise CorruptData(f"catalog file {shown!r}: the meta pages disagree on the page size")
    meta = m1 if m0.txnid < m1.txnid else m0  # the one LMDB picks
    npages = meta.last_pg + 1
    if meta.last_pg < 1 or npages * psize > size:
        raise CorruptData(f"catalog file {shown!r} is truncated or damaged: its meta says "
                          f"{npages} pages of {psize} bytes, the file has {size} bytes")
    if walk:
        _Walk(fd, shown, psize, npages).check(meta)


class _Walk:
    def __init__(self, fd: int, shown: str, psize: int, npages: int) -> None:
        self.fd, self.shown, self.psize, self.npages = fd, shown, psize, npages
        self.seen: set[int] = set()

    def bad(self, what: str) -> CorruptData:
        return CorruptData(f"catalog file {self.shown!r} is damaged: {what}")

    def check(self, meta: _Meta) -> None:
        for db in meta.dbs:
            self.tree(db, named=db is meta.dbs[1])

    def page(self, pgno: int) -> bytes:
        if not 2 <= pgno < self.npages:
            raise self.bad(f"page {pgno} is outside the used pages 2..{self.npages - 1}")
        if len(self.seen) >= MAX_PAGES:
            raise self.bad("too many pages")
        p = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(p) != self.psize:
            raise self.bad(f"page {pgno} is truncated")
        if struct.unpack_from("<Q", p, 0)[0] != pgno:
            raise self.bad(f"page {pgno} holds the number of another page")
        return p

    def tree(self, db: tuple, *, named: bool) -> None:
        _, flags, depth, *_, root = db
        if root == P_INVALID:
            return
        if not 1 <= depth <= MAX_DEPTH:
            raise self.bad(f"a database has an invalid depth {depth}")
        self.node(root, depth, named=named, dupsort=bool(flags & 0x04))

    def node(self, pgno: int, depth: int, *, named: bool, dupsort: bool) -> None:
        self.visit(pgno)
        self.check_page(pgno, self.page(pgno), depth, named=named, dupsort=dupsort)

    def visit(self, pgno: int) -> None:
        if pgno in self.seen:
            raise self.bad(f"page {pgno} is reachable twice")
        self.seen.add(pgno)

    def leaves(self, pgnos: list[int], *, named: bool, dupsort: bool) -> None:
        """Check the leaf pages ``pgnos`` (the children of one branch page) as
        :meth:`node` would, most of them at once: a page whose every node is a plain one
        (key and data inside the page) is accepted by a vectorized check; any other page,
        whatever looks wrong or special in it, goes through :meth:`check_page` (which
        accepts it or raises, exactly as for a page checked alone)."""
        pages = []
        for pgno in pgnos:
            self.visit(pgno)
            pages.append(self.page(pgno))
        slow = set(range(len(pages))) if named or not pages else _unplain(
            pages, self.psize, dupsort)
        for i in sorted(slow):
            self.check_page(pgnos[i], pages[i], 1, named=named, dupsort=dupsort)

    def check_page(self, pgno: int, p: bytes, depth: int, *, named: bool,
                   dupsort: bool) -> None:
        flags, lower, upper = struct.unpack_from("<HHH", p, 10)
        if flags & P_LEAF2:
            raise self.bad(f"page {pgno}: fixed-size leaf pages are not used by the store")
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META)
        want = P_BRANCH if depth > 1 else P_LEAF
        if kind != want:
            raise self.bad(f"page {pgno} has flags {flags:#x} where a "
                           f"{'branch' if want == P_BRANCH else 'leaf'} page belongs")
        if not (PAGEHDR <= lower <= upper <= self.psize) or (lower - PAGEHDR) % 2:
            raise self.bad(f"page {pgno} has invalid bounds lower={lower} upper={upper}")
        n = (lower - PAGEHDR) // 2
        if n == 0:
            raise self.bad(f"page {pgno} is empty")
        ptrs = struct.unpack_from(f"<{n}H", p, PAGEHDR)
        children: list[int] = []  # of a branch page above leaves: checked together
        for i, off in enumerate(ptrs):
            if not upper <= off <= self.psize - NODEHDR:
                raise self.bad(f"page {pgno}, node {i}: offset {off} outside the page")
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, off)
            dsize = lo | (hi << 16)
            kend = off + NODEHDR + ksize
            if kend > self.psize:
                raise self.bad(f"page {pgno}, node {i}: key runs past the page")
            if want == P_BRANCH:
                child = dsize | (nflags << 32)  # a branch node's child page number
                if depth == 2:
                    children.append(child)
                else:
                    self.node(child, depth - 1, named=named, dupsort=dupsort)
                continue
            if nflags & F_DUPDATA and not dupsort:
                raise self.bad(f"page {pgno}, node {i}: duplicate data in a plain database")
            if nflags & F_BIGDATA:
                if kend + 8 > self.psize:
                    raise self.bad(f"page {pgno}, node {i}: overflow page number past the page")
                self.overflow(struct.unpack_from("<Q", p, kend)[0], dsize)
            elif kend + dsize > self.psize:
                raise self.bad(f"page {pgno}, node {i}: data runs past the page")
            if nflags & F_SUBDATA:
                if not named or nflags & F_BIGDATA or dsize != DB_SIZE:
                    raise self.bad(f"page {pgno}, node {i}: an invalid named-database record")
                self.tree(_DB.unpack_from(p, kend), named=False)
        if children:
            self.leaves(children, named=named, dupsort=dupsort)

    def overflow(self, pgno: int, dsize: int) -> None:
        if pgno in self.seen:
            raise self.bad(f"overflow page {pgno} is reachable twice")
        p = self.page(pgno)
        flags = struct.unpack_from("<H", p, 10)[0]
        pages = struct.unpack_from("<I", p, 12)[0]
        if not flags & P_OVERFLOW or pages < 1 or pgno + pages > self.npages \
                or PAGEHDR + dsize > pages * self.psize:
            raise self.bad(f"overflow page {pgno} is invalid ({pages} pages for {dsize} bytes)")
        self.seen.update(range(pgno, pgno + pages))


_HDR = np.arange(NODEHDR)


def _unplain(pages: list[bytes], psize: int, dupsort: bool) -> set[int]:
    """Indexes of the leaf pages among ``pages`` that a vectorized check cannot accept: all
    but those flagged as plain leaf pages with valid bounds whose every node offset lies
    inside the page and whose every node is a plain key and value inside the page (no
    overflow data, no named database, no duplicates unless ``dupsort``)."""
    buf = np.frombuffer(b"".join(pages), np.uint8).reshape(len(pages), psize)
    hdr = np.ascontiguousarray(buf[:, 10:16]).view("<u2").astype(np.int64)
    flags, lower, upper = hdr[:, 0], hdr[:, 1], hdr[:, 2]
    ok = ((flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2)) == P_LEAF) \
        & (PAGEHDR < lower) & (lower <= upper) & (upper <= psize) & ((lower - PAGEHDR) % 2 == 0)
    n = np.where(ok, (lower - PAGEHDR) // 2, 0)
    width = int(n.max()) if len(n) else 0
    if width:
        ptrs = np.ascontiguousarray(buf[:, PAGEHDR : PAGEHDR + 2 * width]).view("<u2")
        rows, cols = np.nonzero(np.arange(width) < n[:, None])
        off = ptrs[rows, cols].astype(np.int64)
        inside = (upper[rows] <= off) & (off <= psize - NODEHDR)
        at = rows * psize + np.where(inside, off, 0)
        node = buf.reshape(-1)[at[:, None] + _HDR].view("<u2").astype(np.int64)
        nflags, ksize = node[:, 2], node[:, 3]
        dsize = node[:, 0] | (node[:, 1] << 16)
        kend = off + NODEHDR + ksize
        special = F_BIGDATA | F_SUBDATA | (0 if dupsort else F_DUPDATA)
        plain = inside & (kend <= psize) & (kend + dsize <= psize) & ((nflags & special) == 0)
        ok[rows[~plain]] = False
    return {int(i) for i in np.flatnonzero(~ok)}
