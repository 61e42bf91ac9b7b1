"""Per-head vector indexes over stored keys, for sparse attention (AlayaDB §6, PQCache §3).

One index per (layer, kv-head), shared by the query heads of its GQA group. Types: ``flat``
(exact scan), ``pq`` (product quantization, asymmetric distance scoring) and ``graph`` (HNSW via
hnswlib on a MIPS-to-L2 transform, with AlayaDB's DIPRS walk for range queries). Queries:
top-k, DIPR(beta) (Definition 3: every key within ``beta`` of the best inner product) and a
prefix filter (only tokens ``< limit``). Indexes keep no key vectors: they read them from the
KV through a :class:`~kvstore.index.keys.HeadKeys` (:mod:`kvstore.index.keys`).
"""

from kvstore.index.build import build_index
from kvstore.index.context_dir import ContextIndexes
from kvstore.index.files import load_index, save_index
from kvstore.index.flat import FlatIndex
from kvstore.index.graph import GraphIndex
from kvstore.index.keys import ArrayKeys, HeadKeys, KeySource
from kvstore.index.pq import PQIndex
from kvstore.index.spec import IndexSpec, recall

__all__ = ["ArrayKeys", "ContextIndexes", "FlatIndex", "GraphIndex", "HeadKeys", "IndexSpec",
           "KeySource", "PQIndex", "build_index", "load_index", "recall", "save_index"]
