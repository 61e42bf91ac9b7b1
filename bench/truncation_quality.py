"""Perplexity after context-window truncation: AS vs TT vs NKVT (AttentionStore Table 1).

Each sample is W + M + 1 consecutive tokens of ChatML-rendered real ShareGPT conversations
(consecutive conversations are concatenated until long enough; samples do not overlap). The
first W tokens are the history that overflowed a context window of W; half of it is dropped
(drop_ratio 0.5, the oldest half) and the next M tokens are then scored teacher-forced: the model
reads continuation tokens c_0..c_{M-1} and the NLL of c_1..c_M is measured (M predictions, all
of continuation tokens). Methods (K = number of kept history tokens):

  as        AttentionStore decoupled truncation: KV of all W tokens computed once (positions
            0..W-1, keys stored pre-RoPE), newest half kept (Truncation.apply from
            engine.truncation: the history fills a window of W, the next token overflows it),
            re-positioned to 0..K-1; continuation at K..K+M-1. No recompute.
  as_sink   the same keeping the first --sink tokens (default 4) as well (Truncation(sink=4)).
  tt        token truncation + recompute: KV of the kept tokens recomputed alone from scratch
            (positions 0..K-1); continuation at K..K+M-1.
  tt_sink   TT with the same kept tokens as as_sink (the recompute reference for it).
  nkvt      naive KV truncation with RoPE baked in: the same kept KV slice as `as`, but its keys
            keep their ORIGINAL positions (W-K..W-1), as an engine that stores post-RoPE keys
            would, while the new tokens get positions K..K+M-1.
  full      reference, no truncation: past = all W tokens (positions 0..W-1), continuation at
            W..W+M-1 (the window is only simulated; the model's own window is 8192).
  none      reference, no history at all: continuation alone at positions 0..M-1.

PPL = exp(mean NLL over all scored tokens of all samples). Also reported: the paired difference
as - tt (PPL and mean NLL with its standard error over samples). JSON (per-sample raw NLLs +
summary) to --out; a table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

import engine
from engine.model import Model, split_kv, stack_kv
from engine.truncation import Truncation

METHODS = ("as", "as_sink", "tt", "tt_sink", "nkvt", "full", "none")
SINK = 4  # default sink tokens of as_sink / tt_sink


def sharegpt_samples(model: Model, n_tokens: int, n_samples: int, *, skip: int = 0
                     ) -> Iterator[tuple[list[int], list[int]]]:
    """``n_samples`` disjoint samples of ``n_tokens`` ChatML ids of consecutive ShareGPT
    conversations (each sample starts at a conversation boundary; a sample concatenates
    conversations until long enough and its unused tail is discarded). Yields (ids, indices of
    the conversations used). ``skip`` conversations are skipped first."""
    from engine.sharegpt import iter_conversations

    ids: list[int] = []
    used: list[int] = []
    made = 0
    for i, msgs in enumerate(iter_conversations()):
        if i < skip:
            continue
        ids += model.chat_template(msgs, add_generation_prompt=False)
        used.append(i)
        if len(ids) >= n_tokens:
            yield ids[:n_tokens], used
            made += 1
            if made == n_samples:
                return
            ids, used = [], []
    raise RuntimeError(f"ShareGPT ran out after {made} samples of {n_tokens} tokens")


def _nll(logits: torch.Tensor, targets: Sequence[int]) -> list[float]:
    # logits [M, V] float32, targets [M] -> per-token NLL (natural log)
    t = torch.as_tensor(list(targets), dtype=torch.int64)
    return F.cross_entropy(logits.float(), t, reduction="none").tolist()


def evaluate_sample(model: Model, ids: Sequence[int], window: int, m: int,
                    methods: Sequence[str] = METHODS, drop_ratio: float = 0.5,
                    sink: int = SINK) -> dict[str, list[float]]:
    """Per-method per-token NLLs [m] of ``ids[window+1 : window+m+1]`` after truncating the
    history ``ids[:window]`` (see the module docstring). ``len(ids)`` must be ``window+m+1``."""
    if len(ids) != window + m + 1:
        raise ValueError(f"need {window + m + 1} ids, got {len(ids)}")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}")
    hist = list(ids[:window])
    cont = list(ids[window: window + m])  # inputs c_0..c_{m-1}
    targets = list(ids[window + 1: window + m + 1])  # c_1..c_m
    out: dict[str, list[float]] = {}

    def cont_nll(past, past_positions=None) -> list[float]:
        p = 0 if past is None else past[0][0].shape[1]
        logits, _ = model.forward(cont, torch.arange(p, p + m), past,
                                  past_positions=past_positions)
        return _nll(logits, targets)

    need_full_kv = any(x in methods for x in ("as", "as_sink", "nkvt", "full"))
    keys = values = None
    if need_full_kv:
        # history KV at positions 0..W-1, keys pre-RoPE (logits not needed)
        _, kv = model.forward(hist, last_only=True)
        keys, values = stack_kv(kv)  # [L, H, W, D]
        del kv
    for n_sink, sfx in ((0, ""), (sink, "_sink")):
        trunc = Truncation(drop_ratio=drop_ratio, sink=n_sink)
        # The history fills a window of W and the next token overflows it: one drop.
        kept = trunc.kept(window, needed=1, window=window)
        if f"as{sfx}" in methods or (sfx == "" and "nkvt" in methods):
            _, k, v = trunc.apply(hist, keys, values, needed=1, window=window)  # [L, H, K, D]
            past = split_kv(k, v)
            if f"as{sfx}" in methods:  # decoupled: re-positioned to 0..K-1 (the default)
                out[f"as{sfx}"] = cont_nll(past)
            if sfx == "" and "nkvt" in methods:  # RoPE baked in at the original positions
                out["nkvt"] = cont_nll(past, past_positions=kept)
        if f"tt{sfx}" in methods:  # recompute the kept tokens alone at 0..K-1
            kept_ids = [hist[i] for i in kept.tolist()]
            _, kv = model.forward(kept_ids, last_only=True)
            out[f"tt{sfx}"] = cont_nll(kv)
    if "full" in methods:
        out["full"] = cont_nll(split_kv(keys, values))
    if "none" in methods:
        out["none"] = cont_nll(None)
    return {name: out[name] for name in methods}


def summarize(per_sample: Sequence[dict[str, list[float]]], methods: Sequence[str]) -> dict:
    """PPL per method (exp of the token-mean NLL) and the paired as - tt difference."""
    res: dict[str, object] = {}
    ppl: dict[str, float] = {}
    mean_nll: dict[str, float] = {}
    for name in methods:
        all_nll = [x for s in per_sample for x in s[name]]
        mean_nll[name] = statistics.fmean(all_nll)
        ppl[name] = math.exp(mean_nll[name])
    res["ppl"] = ppl
    res["mean_nll"] = mean_nll
    res["sample_ppl"] = {name: [math.exp(statistics.fmean(s[name])) for s in per_sample]
                         for name in methods}
    for a, b in (("as", "tt"), ("as_sink", "tt_sink")):
        if a in methods and b in methods:
            d = [statistics.fmean(s[a]) - statistics.fmean(s[b]) for s in per_sample]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            res[f"{a}-{b}"] = {"ppl_diff": ppl[a] - ppl[b], "ppl_rel": ppl[a] / ppl[b] - 1,
                               "mean_nll_diff": statistics.fmean(d), "nll_diff_se": se,
                               "samples_a_better": sum(x < 0 for x in d), "samples": len(d)}
    return res


def run(model: Model, window: int, m: int, n_samples: int, *, skip: int = 0,
        methods: Sequence[str] = METHODS, drop_ratio: float = 0.5, sink: int = SINK,
        verbose: bool = False) -> dict:
    samples = []
    t0 = time.perf_counter()
    for j, (ids, convs) in enumerate(sharegpt_samples(model, window + m + 1, n_samples,
                                                      skip=skip)):
        nll = evaluate_sample(model, ids, window, m, methods, drop_ratio, sink)
        samples.append({"conversations": convs, "nll": nll})
        if verbose:
            ppl = "  ".join(f"{k}={math.exp(statistics.fmean(v)):.2f}" for k, v in nll.items())
            print(f"  W={window} sample {j} (convs {convs[0]}..{convs[-1]}): {ppl}", flush=True)
    return {"window": window, "continuation": m, "kept": Truncation(
        drop_ratio=drop_ratio).kept_length(window, needed=1, window=window), "samples": samples,
        "summary": summarize([s["nll"] for s in samples], methods),
        "seconds": time.perf_counter() - t0}


def format_table(results: Sequence[dict], methods: Sequence[str], sink: int = SINK) -> str:
    """Markdown tables: PPL per method, then the paired AS - TT differences."""
    names = [x.replace("_sink", f"_sink{sink}") for x in methods]
    head = "| W | K | M | samples | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(f"| {r['window']} | {r['kept']} | {r['continuation']} | "
                     f"{len(r['samples'])} | "
                     + " | ".join(f"{r['summary']['ppl'][x]:.3f}" for x in methods) + " |")
    pairs = [p for p in ("as-tt", "as_sink-tt_sink") if p in results[0]["summary"]] \
        if results else []
    if pairs:
        lines += ["", "| W | pair | PPL diff | rel. | mean ΔNLL ± s.e. | samples a < b |",
                  "|---|---|---|---|---|---|"]
        for r in results:
            for pair in pairs:
                d = r["summary"][pair]
                lines.append(
                    f"| {r['window']} | {pair.replace('_sink', f'_sink{sink}')} | "
                    f"{d['ppl_diff']:+.3f} | {d['ppl_rel']:+.2%} | "
                    f"{d['mean_nll_diff']:+.4f} ± {d['nll_diff_se']:.4f} | "
                    f"{d['samples_a_better']}/{d['samples']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--windows", default="1024,512", help="history = window sizes W, in tokens")
    p.add_argument("--continuation", type=int, default=256, help="M, scored tokens per sample")
    p.add_argument("--samples", type=int, default=8, help="samples per window")
    p.add_argument("--skip", type=int, default=0, help="ShareGPT conversations to skip first")
    p.add_argument("--drop-ratio", type=float, default=0.5)
    p.add_argument("--sink", type=int, default=SINK, help="sink tokens kept by as_sink/tt_sink")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench/results/truncation_quality.json")
    p.add_argument("-v", "--verbose", action="store_true", help="print per-sample PPL")
    args = p.parse_args(argv)
    windows = [int(x) for x in args.windows.split(",")]
    methods = [x for x in args.methods.split(",") if x]

    t0 = time.perf_counter()
    model = engine.load_model(num_threads=args.threads)
    results = [run(model, w, args.continuation, args.samples, skip=args.skip, methods=methods,
                   drop_ratio=args.drop_ratio, sink=args.sink, verbose=args.verbose)
               for w in windows]
    report = {
        "command": "python bench/truncation_quality.py " + " ".join(
            argv if argv is not None else __import__("sys").argv[1:]),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "model": model.layout.model_id, "kv_dtype": model.layout.dtype,
        "drop_ratio": args.drop_ratio, "sink": args.sink, "methods": methods,
        "results": results, "total_seconds": time.perf_counter() - t0,
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(format_table(results, methods, args.sink))
    print(f"total {report['total_seconds']:.0f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
