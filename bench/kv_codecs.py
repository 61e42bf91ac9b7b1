"""KV codecs on real SmolLM2 KV: size, speed, cold-disk gets, and quality.

Real KV: the model's fp16 KV (keys pre-RoPE) of ``--kv-tokens`` ChatML tokens of ShareGPT
conversations that the other benches do not use (``--skip``). Per codec (``none`` is the raw
baseline, measured in the same run):

* ``bytes_per_token``: stored bytes of the context's chunks / tokens (the store's
  ``stats()["disk"]["stored_bytes"]``), and the ratio raw / stored.
* ``encode_gbps`` / ``decode_gbps``: raw bytes / seconds of ``kvstore.codecs.layer_codec.encode`` /
  ``decode`` over every (chunk, layer), one thread, with the default decoders (native C for
  int8/fp8/int4 where built, and the native int8 encoder); ``decode_numpy_gbps``: the numpy/
  torch decoders of the same bytes in the same repetitions; the ceiling beside them is a numpy
  copy of the same bytes (``memcpy_gbps``).
* ``cold_get``: ``store.get`` of the whole context after ``store.debug.drop_caches()`` (DRAM tier
  and page cache of the segments emptied), effective GB/s = decoded (raw) bytes / s,
  alternating with a raw store holding the same KV (``raw_get``), so each coded sample has a
  raw one taken just before it on the same disk under the same load; ``pair_ratios``: raw s /
  coded s of each pair (> 1: the codec's get is faster).
* ``--no-quality`` skips the model quality part (perplexity and greedy agreement depend only on
  the decoded bytes, which the native and numpy decoders produce identically).

Quality (``--samples`` prompts of ``--prompt`` tokens, from further conversations): each prompt's
KV is computed once, stored through the codec, the DRAM tier dropped, and then

* teacher-forced NLL of the next ``--continuation`` tokens with the past read back from the
  store (``store.get``), against the fp16 past: PPL, its relative delta, and the max / mean
  absolute logit difference;
* greedy generation of ``--new-tokens`` tokens by ``engine.Generator`` reusing the stored
  prompt (layer-wise load) against a full recompute (``reuse=False``): positions equal and the
  length of the equal prefix; ``lossy`` says whether the Generator reported a lossy prefix.

``--decode-into`` (a micro benchmark on its own, no model): a get of coded chunks held in
memory, on ``--kv-tokens`` tokens of random fp16 KV in SmolLM2-135M's layout (30 layers, 3 kv
heads, head_dim 64, chunks of 256 tokens), one thread, int8 (``--codecs``): GB/s of decoded
bytes of ``decode_layers`` of every chunk into its extent (preallocated, as DRAM slots) plus
one ``kvstore.pipelines.gather.gather`` of them all into keys and values [L, H, T, D] (what a get
does
today), against ``layer_codec.decode_into`` of every chunk straight into [L, H, T, D]; both with
the native decoders, checked to write the same bytes, alternating in each repetition.

Usage (the numbers in docs/benchmarks/codecs.md):
    PYTHONPATH=src .venv/bin/python bench/kv_codecs.py --out bench/results/kv_codecs.json
    PYTHONPATH=src .venv/bin/python bench/kv_codecs.py --no-quality --reps 7  # speed only
    PYTHONPATH=src .venv/bin/python bench/kv_codecs.py --decode-into --codecs int8 --reps 15 \
        --out bench/results/kv_codecs_decode_into.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import machine_info, summarize  # noqa: E402

import kvstore  # noqa: E402
from kvstore.codecs import (
    layer_codec,  # noqa: E402
    native_decoders,  # noqa: E402
)
from kvstore.codecs.layer_codec import LayerShape  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.pipelines.gather import gather  # noqa: E402

CHUNK = 256


def sharegpt_ids(model, n_tokens: int, n_samples: int, skip: int) -> list[list[int]]:
    from truncation_quality import sharegpt_samples
    return [ids for ids, _ in sharegpt_samples(model, n_tokens, n_samples, skip=skip)]


def layer_raws(k: torch.Tensor, v: torch.Tensor) -> list[tuple[np.ndarray, LayerShape]]:
    """Raw bytes of every (chunk, layer) of KV [L, H, T, D], as the store lays them out."""
    L, H, T, D = k.shape
    out = []
    for a in range(0, T, CHUNK):
        b = min(a + CHUNK, T)
        shape = LayerShape("float16", H, b - a, D)
        for layer in range(L):
            x = torch.stack([k[layer, :, a:b], v[layer, :, a:b]]).contiguous()
            out.append((x.view(torch.int16).numpy().reshape(-1).view(np.uint8).copy(), shape))
    return out


def time_codec(name: str, raws, reps: int) -> dict:
    """Encode and decode speed over every (chunk, layer), one thread; lossy codecs' decode both
    native (the default path) and numpy/torch; memcpy of the same bytes as the ceiling."""
    nbytes = sum(r.nbytes for r, _ in raws)
    enc_s, dec_s, np_s, copy_s = [], [], [], []
    encoded = [layer_codec.encode(name, r, s) for r, s in raws]  # warmup
    outs = [np.empty(r.nbytes, dtype=np.uint8) for r, _ in raws]
    natives = [True, False] if name in layer_codec.LOSSY and native_decoders.AVAILABLE else [None]
    for _ in range(reps):
        t = time.perf_counter()
        encoded = [layer_codec.encode(name, r, s) for r, s in raws]
        enc_s.append(time.perf_counter() - t)
        for native in natives:
            t = time.perf_counter()
            for e, (_, s), o in zip(encoded, raws, outs, strict=True):
                layer_codec.decode(name, e, s, o, native=native)
            (np_s if native is False else dec_s).append(time.perf_counter() - t)
        t = time.perf_counter()
        for (r, _), o in zip(raws, outs, strict=True):
            np.copyto(o, r)
        copy_s.append(time.perf_counter() - t)
    out = {"encode": summarize(enc_s, nbytes), "decode": summarize(dec_s, nbytes),
           "memcpy": summarize(copy_s, nbytes),
           "encoded_bytes": sum(len(e) for e in encoded), "raw_bytes": nbytes}
    if np_s:
        out["decode_numpy"] = summarize(np_s, nbytes)
    return out


def decode_into_speed(name: str, n_tokens: int, reps: int, seed: int = 0) -> dict:
    """Decoded GB/s of a get of coded chunks held in memory, one thread: ``decode_layers``
    into each chunk's extent + one gather into [L, H, T, D], against ``decode_into`` straight
    into [L, H, T, D] (same outputs, reused; alternating within each repetition)."""
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(L, H, n_tokens, D, generator=g).half() for _ in range(2))
    raws = layer_raws(k, v)  # chunk-major: chunk c's layers are raws[c * L : (c + 1) * L]
    chunks = []  # (data, spans, shape, start, extent)
    for c, a in enumerate(range(0, n_tokens, CHUNK)):
        enc = [layer_codec.encode(name, r, s) for r, s in raws[c * L : (c + 1) * L]]
        shape = raws[c * L][1]
        offs = np.cumsum([0] + [len(e) for e in enc[:-1]])
        chunks.append((np.frombuffer(b"".join(enc), dtype=np.uint8),
                       [(int(o), len(e)) for o, e in zip(offs, enc, strict=True)], shape, a,
                       np.empty(L * shape.raw_bytes, dtype=np.uint8)))
    k_out, v_out = (np.empty((L, H, n_tokens, D), dtype=np.int16) for _ in range(2))

    def via_extents() -> None:
        for data, spans, shape, _, ext in chunks:
            layer_codec.decode_layers(name, data, spans, shape, ext)
        gather(layout, k_out, v_out, [(ext, s.n_tokens, a, s.n_tokens)
                                      for _, _, s, a, ext in chunks])

    def straight() -> None:
        for data, spans, shape, a, _ in chunks:
            layer_codec.decode_into(name, data, spans, shape, k_out, v_out, a, shape.n_tokens)

    straight()
    want = (k_out.copy(), v_out.copy())
    via_extents()  # warmup, and the same bytes
    if not (np.array_equal(k_out, want[0]) and np.array_equal(v_out, want[1])):
        raise AssertionError("decode_into and decode_layers + gather wrote different bytes")
    samples: dict[str, list[float]] = {"extent_gather": [], "decode_into": []}
    for _ in range(reps):
        for key, fn in (("extent_gather", via_extents), ("decode_into", straight)):
            t = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t)
    nbytes = 2 * k_out.nbytes
    out = {key: summarize(x, nbytes) for key, x in samples.items()}
    out.update({"codec": name, "tokens": n_tokens, "decoded_bytes": nbytes,
                "layout": [L, H, D], "native": native_decoders.AVAILABLE,
                "pair_ratios": [a / b for a, b in zip(samples["extent_gather"],
                                                      samples["decode_into"], strict=True)]})
    return out


def cold_gets(path: str, layout, name: str, toks, k, v, reps: int, *,
              slots: bool = False) -> dict:
    """Cold ``store.get`` of the whole context through codec ``name``, alternating with a raw
    store holding the same KV (so both see the same disk and the same neighbours' load);
    ``pair_ratios``: raw seconds / coded seconds of each adjacent pair. ``slots``: the coded
    store's disk slots are sized for the codec (``slot_codec``), so its chunks lie next to
    each other."""
    kw = {"layout": layout, "chunk_tokens": CHUNK, "disk_bytes": 4 << 30}
    extra = {"slot_codec": name} if slots else {}
    with kvstore.open(path, codecs={"disk": name}, **extra, **kw) as store, \
            kvstore.open(path + "-raw", **kw) as raw:
        store.put(toks, k, v)
        raw.put(toks, k, v)
        stored = store.stats()["disk"]["stored_bytes"]
        samples, raw_samples = [], []
        for i in range(reps + 1):
            for st, out in ((raw, raw_samples), (store, samples)):
                st.debug.drop_caches()
                t = time.perf_counter()
                gk, gv = st.get(toks)
                dt = time.perf_counter() - t
                if i:
                    out.append(dt)
        lossy = store.stats()["codecs"]["lossy_tokens_served"]
        err = max(float((gk.float() - k.float()).abs().max()),
                  float((gv.float() - v.float()).abs().max()))
    shutil.rmtree(path + "-raw", ignore_errors=True)
    nbytes = 2 * k.numel() * k.element_size()
    return {"get": summarize(samples, nbytes), "raw_get": summarize(raw_samples, nbytes),
            "pair_ratios": [r / c for r, c in zip(raw_samples, samples, strict=True)],
            "stored_bytes": stored, "bytes_per_token": stored / len(toks),
            "lossy_tokens_served": lossy, "max_abs_error": err}


def quality(model, prompts, conts, name: str, workdir: str, new_tokens: int,
            ref: list[dict]) -> list[dict]:
    from engine import Generator
    from engine.model import split_kv

    out = []
    for i, (ids, cont) in enumerate(zip(prompts, conts, strict=True)):
        path = os.path.join(workdir, f"q-{name}-{i}")
        with kvstore.open(path, layout=model.layout, chunk_tokens=CHUNK, disk_bytes=1 << 30,
                          codecs={"disk": name}) as store:
            k, v = ref[i]["kv"]
            store.put(ids, k, v)
            store.debug.drop_caches()
            gk, gv = store.get(ids)
            m = len(cont) - 1
            logits, _ = model.forward(cont[:m], torch.arange(len(ids), len(ids) + m),
                                      split_kv(gk, gv))
            nll = F.cross_entropy(logits.float(), torch.tensor(cont[1:]),
                                  reduction="none").tolist()
            dl = (logits.float() - ref[i]["logits"]).abs()
            store.debug.drop_caches()
            r = Generator(model, store, async_save=False).generate(ids, new_tokens, store=False)
            want = ref[i]["tokens"]
            same = [a == b for a, b in zip(r.tokens, want, strict=False)]
            prefix = next((j for j, s in enumerate(same) if not s), len(same))
            out.append({"nll": nll, "ppl": math.exp(sum(nll) / len(nll)),
                        "ref_ppl": math.exp(sum(ref[i]["nll"]) / len(nll)),
                        "logit_max_abs_delta": float(dl.max()),
                        "logit_mean_abs_delta": float(dl.mean()),
                        "greedy_tokens": r.tokens, "greedy_equal_positions": sum(same),
                        "greedy_equal_prefix": prefix, "greedy_len": len(want),
                        "reused_tokens": r.reused_tokens,
                        "lossy_reused_tokens": r.lossy_reused_tokens})
        shutil.rmtree(path, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codecs", default=",".join(layer_codec.NAMES))
    p.add_argument("--kv-tokens", type=int, default=2048, help="tokens of the size/speed context")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (after 1 warmup)")
    p.add_argument("--samples", type=int, default=4, help="quality prompts")
    p.add_argument("--prompt", type=int, default=600, help="tokens per quality prompt")
    p.add_argument("--continuation", type=int, default=129, help="teacher-forced tokens + 1")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared")
    p.add_argument("--skip", type=int, default=5000,
                   help="ShareGPT conversations skipped (other benches use 0-80 and 3000)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--out", default="bench/results/kv_codecs.json")
    p.add_argument("--slot-codec", action="store_true",
                   help="cold gets from a store whose disk slots are sized for the codec "
                        "(slot_codec; int8, fp8 and int4 only)")
    p.add_argument("--decode-into", action="store_true",
                   help="only the decode_into micro benchmark (no model; random KV in "
                        "SmolLM2's layout)")
    p.add_argument("--no-quality", action="store_true",
                   help="size and speed only (quality does not depend on which decoder runs: "
                        "native and numpy decode to the same bytes)")
    args = p.parse_args(argv)
    names = [x for x in args.codecs.split(",") if x]
    for x in names:
        layer_codec.check_name(x, "--codecs")
        if args.slot_codec and x in ("none", "zstd"):
            p.error(f"--slot-codec needs fixed-size codecs (int8, fp8, int4), got {x!r}")

    if args.decode_into:
        return run_decode_into(args, names, argv)

    import engine
    from engine.model import stack_kv

    t0 = time.perf_counter()
    model = engine.load_model(num_threads=args.threads)
    workdir = tempfile.mkdtemp(prefix="kvstore-codecs-", dir=args.dir)
    report: dict = {"command": "python bench/kv_codecs.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine_info(),
        "chunk_tokens": CHUNK, "codecs": {}}
    try:
        ids = sharegpt_ids(model, args.kv_tokens, 1, args.skip)[0]
        _, kv = model.forward(ids, last_only=True)
        k, v = stack_kv(kv)
        k, v = k.to(torch.float16).contiguous(), v.to(torch.float16).contiguous()
        raws = layer_raws(k, v)
        print(f"KV of {len(ids)} tokens: {2 * k.numel() * 2 / 1e6:.1f} MB", flush=True)

        samples = [] if args.no_quality else sharegpt_ids(
            model, args.prompt + args.continuation, args.samples, args.skip + 200)
        prompts = [s[: args.prompt] for s in samples]
        conts = [s[args.prompt :] for s in samples]
        ref = []
        gen_store = os.path.join(workdir, "ref")
        with kvstore.open(gen_store, layout=model.layout, chunk_tokens=CHUNK) as store:
            gen = engine.Generator(model, store, async_save=False)
            for pr, ct in zip(prompts, conts, strict=True):
                _, pkv = model.forward(pr, last_only=True)
                pk, pv = stack_kv(pkv)
                m = len(ct) - 1
                logits, _ = model.forward(ct[:m], torch.arange(len(pr), len(pr) + m), pkv)
                nll = F.cross_entropy(logits.float(), torch.tensor(ct[1:]),
                                      reduction="none").tolist()
                r = gen.generate(pr, args.new_tokens, reuse=False, store=False)
                ref.append({"kv": (pk.to(torch.float16), pv.to(torch.float16)),
                            "logits": logits.float(), "nll": nll, "tokens": r.tokens})
        print("references done", flush=True)
        report["native_decoders"] = native_decoders.AVAILABLE

        for name in names:
            res: dict = {"lossy": name in layer_codec.LOSSY}
            res["speed"] = time_codec(name, raws, args.reps)
            res["cold"] = cold_gets(os.path.join(workdir, f"cold-{name}"), model.layout, name,
                                    ids, k, v, args.reps, slots=args.slot_codec)
            shutil.rmtree(os.path.join(workdir, f"cold-{name}"), ignore_errors=True)
            res["summary"] = {
                "bytes_per_token": res["cold"]["bytes_per_token"],
                "ratio": 2 * k.numel() * 2 / res["cold"]["stored_bytes"],
                "encode_gbps_p50": res["speed"]["encode"]["gbps_p50"],
                "decode_gbps_p50": res["speed"]["decode"]["gbps_p50"],
                "decode_numpy_gbps_p50": res["speed"].get("decode_numpy", {}).get("gbps_p50"),
                "memcpy_gbps_p50": res["speed"]["memcpy"]["gbps_p50"],
                "cold_get_gbps_p50": res["cold"]["get"]["gbps_p50"],
                "raw_cold_get_gbps_p50": res["cold"]["raw_get"]["gbps_p50"],
                "cold_get_vs_raw_pairs_p50": float(np.median(res["cold"]["pair_ratios"])),
                "kv_max_abs_error": res["cold"]["max_abs_error"],
            }
            sm = res["summary"]
            line = (f"{name:5s} {sm['bytes_per_token']:8.0f} B/tok x{sm['ratio']:.2f}  enc "
                    f"{sm['encode_gbps_p50']:.2f} dec {sm['decode_gbps_p50']:.2f} GB/s "
                    f"(numpy {sm['decode_numpy_gbps_p50'] or 0:.2f}; memcpy "
                    f"{sm['memcpy_gbps_p50']:.1f})  cold get {sm['cold_get_gbps_p50']:.2f} GB/s "
                    f"vs raw {sm['raw_cold_get_gbps_p50']:.2f} (pairs: "
                    f"x{sm['cold_get_vs_raw_pairs_p50']:.2f})")
            if not args.no_quality:
                res["quality"] = quality(model, prompts, conts, name, workdir, args.new_tokens,
                                         ref)
                q = res["quality"]
                all_nll = [x for s in q for x in s["nll"]]
                ref_nll = [x for r in ref for x in r["nll"]]
                sm.update({
                    "ppl": math.exp(sum(all_nll) / len(all_nll)),
                    "ref_ppl": math.exp(sum(ref_nll) / len(ref_nll)),
                    "greedy_equal_positions": sum(s["greedy_equal_positions"] for s in q),
                    "greedy_equal_prefix": [s["greedy_equal_prefix"] for s in q],
                    "greedy_total": sum(s["greedy_len"] for s in q),
                    "logit_max_abs_delta": max(s["logit_max_abs_delta"] for s in q),
                    "logit_mean_abs_delta": float(np.mean([s["logit_mean_abs_delta"]
                                                           for s in q])),
                    "generator_reported_lossy": all(s["lossy_reused_tokens"] > 0 for s in q),
                })
                sm["ppl_delta_pct"] = 100 * (sm["ppl"] / sm["ref_ppl"] - 1)
                line += (f"  PPL {sm['ppl']:.4f} vs {sm['ref_ppl']:.4f} "
                         f"({sm['ppl_delta_pct']:+.2f}%)  greedy {sm['greedy_equal_positions']}/"
                         f"{sm['greedy_total']} prefixes {sm['greedy_equal_prefix']}  "
                         f"lossy={sm['generator_reported_lossy']}")
            report["codecs"][name] = res
            print(line, flush=True)
        if "none" in report["codecs"]:
            base = report["codecs"]["none"]["summary"]["cold_get_gbps_p50"]
            for res in report["codecs"].values():
                res["summary"]["cold_get_vs_raw"] = res["summary"]["cold_get_gbps_p50"] / base
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["total_seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"total {report['total_seconds']:.0f} s; JSON: {args.out}")
    return 0


def run_decode_into(args: argparse.Namespace, names: list[str], argv: list[str] | None) -> int:
    """``--decode-into``: :func:`decode_into_speed` of each lossy codec named, as JSON."""
    torch.set_num_threads(1)
    report: dict = {"command": "python bench/kv_codecs.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine_info(),
        "chunk_tokens": CHUNK, "decode_into": {}}
    for name in names:
        if name not in layer_codec.LOSSY:
            continue
        r = decode_into_speed(name, args.kv_tokens, args.reps)
        report["decode_into"][name] = r
        print(f"{name:5s} decode_layers + gather {r['extent_gather']['gbps_p50']:.2f} GB/s, "
              f"decode_into {r['decode_into']['gbps_p50']:.2f} GB/s (pairs: x"
              f"{float(np.median(r['pair_ratios'])):.2f}; {r['decoded_bytes'] / 1e6:.1f} MB)",
              flush=True)
    report["machine"]["loadavg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
