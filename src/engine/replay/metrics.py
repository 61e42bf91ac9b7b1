"""Per-turn records and the summary of a replay; Parquet, JSON and PNG outputs."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

from engine.replay.server import Job, ServerStats
from kvstore.format.durable import atomic_write

COLUMNS = ("method", "conv", "conv_id", "turn", "seq", "warmup", "arrival_s", "start_s",
           "first_token_s", "finish_s", "ttft_s", "queue_s", "load_s", "compute_s", "decode_s",
           "history_tokens", "kept_tokens", "prompt_tokens", "reused_tokens", "prefilled_tokens",
           "recomputed_tokens", "reply_tokens", "hit", "truncated", "first_token")


def rows(label: str, jobs: Sequence[Job]) -> dict[str, list]:
    """Column lists, one entry per turn (arrival order)."""
    out: dict[str, list] = {c: [] for c in COLUMNS}
    for j in jobs:
        vals = (label, j.conv.index, j.conv.conv_id, j.turn, j.seq, j.warmup, j.arrival_s,
                j.start_s, j.first_token_s, j.finish_s, j.first_token_s - j.arrival_s,
                j.start_s - j.arrival_s, j.load_s, j.compute_s, j.decode_s, j.history, j.kept,
                j.prompt_len, j.reused, j.prompt_len - j.reused, j.recomputed, j.reply_len, j.hit,
                j.truncated, j.token)
        for c, v in zip(COLUMNS, vals, strict=True):
            out[c].append(v)
    return out


def _pct(a: np.ndarray) -> dict[str, float]:
    if not len(a):
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(cols: dict[str, list], stats: ServerStats, *, cost: dict[str, float] | None = None,
              store: dict | None = None) -> dict[str, object]:
    """Metrics over the measured (non-warm-up) turns. Hit rates are over turns that have a
    history to reuse (turn >= 2); ``token_reuse`` is reused / kept history tokens. The
    server-wide figures (``makespan_s``, ``gpu_s``, the busy times, and the cost) cover the
    whole run, warm-up included."""
    c = {k: np.asarray(v) for k, v in cols.items()}
    m = ~c["warmup"].astype(bool)
    later = m & (c["turn"] > 0)
    hits = c["hit"][later]
    n_later = int(later.sum())

    def rate(*tiers: str) -> float:
        return float(np.isin(hits, tiers).sum() / n_later) if n_later else math.nan

    kept = int(c["kept_tokens"][later].sum())
    out: dict[str, object] = {
        "turns": int(m.sum()),
        "turns_with_history": n_later,
        "warmup_turns": int((~m).sum()),
        "hit_rate": rate("dram", "disk", "remote", "engine"),
        "engine_hit_rate": rate("engine"),  # an engine's own prefix cache (vLLM's)
        "dram_hit_rate": rate("dram"),
        "disk_hit_rate": rate("disk"),
        "remote_hit_rate": rate("remote"),
        "truncated_turns": int(c["truncated"][m].sum()),
        "token_reuse": float(c["reused_tokens"][later].sum() / kept) if kept else math.nan,
        "prompt_tokens": int(c["prompt_tokens"][m].sum()),
        "prefilled_tokens": int(c["prefilled_tokens"][m].sum()),
        "reused_tokens": int(c["reused_tokens"][m].sum()),
        "ttft_s": _pct(c["ttft_s"][m]),
        "ttft_s_turn2plus": _pct(c["ttft_s"][later]),
        "service_s_turn2plus": _pct((c["load_s"] + c["compute_s"])[later]),
        "queue_s": _pct(c["queue_s"][m]),
        "compute_s": float((c["compute_s"][m]).sum()),
        "load_exposed_s": float((c["load_s"][m]).sum()),
        "makespan_s": stats.makespan_s,
        "gpu_s": stats.gpu_s,
        "prefill_busy_s": stats.prefill_busy_s,
        "decode_busy_s": stats.decode_busy_s,
    }
    busy = float((c["compute_s"] + c["load_s"])[m].sum())
    out["prefill_throughput_tok_s"] = out["prompt_tokens"] / busy if busy > 0 else math.nan
    if cost is not None:
        out["cost_usd"] = cost
    if store is not None:
        out["store"] = store
    return out


def write_turns(path: str, tables: Sequence[dict[str, list]]) -> None:
    """All methods' per-turn rows in one Parquet file (written atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    merged: dict[str, list] = {c: [] for c in COLUMNS}
    for t in tables:
        for c in COLUMNS:
            merged[c].extend(t[c])
    table = pa.table(merged)
    atomic_write(path, lambda f: pq.write_table(table, f))


def _finite(obj: object) -> object:
    """NaN/inf -> None, so the file is valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str, obj: object) -> None:
    """``obj`` as JSON (NaN/inf as null), written atomically."""
    atomic_write(path, json.dumps(_finite(obj), indent=2, default=float, allow_nan=False) + "\n")


def plot_ttft_cdf(path: str, tables: Sequence[dict[str, list]]) -> None:
    """CDF of TTFT on measured turns >= 2, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for t in tables:
        c = {k: np.asarray(v) for k, v in t.items()}
        sel = ~c["warmup"].astype(bool) & (c["turn"] > 0)
        x = np.sort(c["ttft_s"][sel])
        if len(x):
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=str(t["method"][0]))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s), turns >= 2")
    ax.set_ylabel("fraction of turns")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(path: str, sweep: Sequence[dict[str, object]], *, x: str = "disk_bytes") -> None:
    """Hit rate (solid) and DRAM hit rate (dashed) against capacity, one colour per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    methods = sorted({str(p["method"]) for p in sweep})
    for i, name in enumerate(methods):
        pts = sorted((p for p in sweep if p["method"] == name), key=lambda p: p[x])
        xs = [p[x] / 1e12 for p in pts]
        colour = f"C{i}"
        ax.plot(xs, [p["hit_rate"] for p in pts], "o-", color=colour, label=name)
        ax.plot(xs, [p["dram_hit_rate"] for p in pts], "x--", color=colour, alpha=0.6)
    ax.set_xlabel("disk capacity (TB)" if x == "disk_bytes" else x)
    ax.set_ylabel("hit rate (dashed: DRAM hits)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
