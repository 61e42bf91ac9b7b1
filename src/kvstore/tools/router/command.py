"""``kvstore route --producer URL --consumer URL``: the prefill/decode router as a command
(its flags are the estimates' priors; docs/vllm.md, "Prefill and decode on different
servers")."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvstore.tools.router.estimates import Priors, RouterState
from kvstore.tools.router.front import MAX_BODY_BYTES, RouterHTTPServer, serve
from kvstore.tools.router.service import MODES, Router, RouterConfig
from kvstore.tools.router.upstream import Upstream


def add_route_command(sub: Any) -> None:
    """Register ``route`` on the ``kvstore`` command's subparsers."""
    r = sub.add_parser("route", help="an OpenAI-compatible router that prefills on a producer "
                                     "where that pays and decodes on a consumer")
    r.add_argument("--producer", required=True, help="the prefill server: http://HOST:PORT")
    r.add_argument("--consumer", required=True, help="the decode server: http://HOST:PORT")
    r.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    r.add_argument("--port", type=int, default=8100,
                   help="listen port (default 8100; 0 picks a free one, printed at start)")
    r.add_argument("--mode", choices=MODES, default="auto",
                   help="auto: decide per request (default); remote / local: always")
    g = r.add_argument_group("the model's KV (one of --kv-bytes-per-token, --layout-from)")
    g.add_argument("--kv-bytes-per-token", type=float, default=None,
                   help="bytes of every full-attention layer's K and V for one token")
    g.add_argument("--kv-fixed-bytes", type=float, default=None,
                   help="a hybrid model's fixed state per context (sliding windows, "
                        "recurrent states) in bytes (default 0)")
    g.add_argument("--layout-from", default=None, metavar="STORE_DIR",
                   help="read both from a store directory's layout (e.g. the producer's)")
    p = r.add_argument_group("priors (what the router measures starts here)")
    p.add_argument("--link-mbps", type=float, default=1000.0,
                   help="the link's bandwidth, megabits per second (default 1000)")
    p.add_argument("--producer-tokens-per-s", type=float, default=1000.0)
    p.add_argument("--consumer-tokens-per-s", type=float, default=1000.0)
    p.add_argument("--producer-fixed-ms", type=float, default=50.0,
                   help="a request's fixed cost on the producer (default 50)")
    p.add_argument("--consumer-fixed-ms", type=float, default=50.0)
    p.add_argument("--tokens-per-char", type=float, default=0.25)
    p.add_argument("--decode-ms-per-token", type=float, default=50.0)
    p.add_argument("--remote-overhead-ms", type=float, default=0.0,
                   help="a fixed cost added to every remote prefill (default 0)")
    p.add_argument("--alpha", type=float, default=0.25,
                   help="each observation's weight in the estimates (default 0.25)")
    p.add_argument("--explore-every", type=int, default=32,
                   help="take a path not taken for this many requests when it is predicted "
                        "within 2x (default 32; 0: never)")
    t = r.add_argument_group("time limits")
    t.add_argument("--prefill-timeout-s", type=float, default=60.0,
                   help="the producer's whole prefill; past it the consumer prefills")
    t.add_argument("--timeout-s", type=float, default=600.0,
                   help="each read of the consumer's answer")
    t.add_argument("--min-deadline-s", type=float, default=2.0,
                   help="the least wait for a remote prefill's KV the consumer is given")
    t.add_argument("--producer-retry-s", type=float, default=10.0,
                   help="after a producer failure, no remote prefill for this long")
    r.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    r.add_argument("--log-level", default="WARNING")
    r.set_defaults(func=run_route)


def _kv_bytes(args: argparse.Namespace) -> tuple[float, float]:
    if args.layout_from is not None:
        if args.kv_bytes_per_token is not None:
            raise ValueError("give --kv-bytes-per-token or --layout-from, not both")
        from kvstore.store.opening import open_store

        with open_store(args.layout_from, readonly=True) as store:
            layout = store.layout
        fixed = layout.state_bytes if args.kv_fixed_bytes is None else args.kv_fixed_bytes
        return float(layout.token_bytes), float(fixed)
    if args.kv_bytes_per_token is None:
        raise ValueError("--kv-bytes-per-token (or --layout-from STORE_DIR) is required: the "
                         "decision weighs the KV's bytes against the link")
    return args.kv_bytes_per_token, args.kv_fixed_bytes or 0.0


def build(args: argparse.Namespace) -> RouterHTTPServer:
    """The router's HTTP server for parsed ``route`` arguments, bound, not serving yet;
    ValueError naming the first bad option."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_body_bytes <= 0:
        raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    per_token, fixed = _kv_bytes(args)
    try:
        priors = Priors(producer_tokens_per_s=args.producer_tokens_per_s,
                        consumer_tokens_per_s=args.consumer_tokens_per_s,
                        producer_fixed_s=args.producer_fixed_ms / 1e3,
                        consumer_fixed_s=args.consumer_fixed_ms / 1e3,
                        link_bytes_per_s=args.link_mbps * 1e6 / 8,
                        kv_bytes_per_token=per_token, kv_fixed_bytes=fixed,
                        tokens_per_char=args.tokens_per_char,
                        decode_s_per_token=args.decode_ms_per_token / 1e3,
                        remote_overhead_s=args.remote_overhead_ms / 1e3, alpha=args.alpha)
    except ValueError as e:  # name the flag, not the field
        raise ValueError(f"{_flag_of(str(e))}: {e}") from None
    if args.explore_every < 0:
        raise ValueError(f"--explore-every must be >= 0, got {args.explore_every}")
    if not args.producer_retry_s > 0:
        raise ValueError(f"--producer-retry-s must be positive, got {args.producer_retry_s}")
    state = RouterState(priors, explore_every=args.explore_every,
                        producer_retry_s=args.producer_retry_s)
    config = RouterConfig(producer=Upstream(name="producer", url=args.producer),
                          consumer=Upstream(name="consumer", url=args.consumer),
                          mode=args.mode, prefill_timeout_s=args.prefill_timeout_s,
                          timeout_s=args.timeout_s, min_deadline_s=args.min_deadline_s)
    return RouterHTTPServer((args.host, args.port), Router(config, state),
                            max_body_bytes=args.max_body_bytes)


_FLAGS = {"producer_tokens_per_s": "--producer-tokens-per-s",
          "consumer_tokens_per_s": "--consumer-tokens-per-s",
          "producer_fixed_s": "--producer-fixed-ms", "consumer_fixed_s": "--consumer-fixed-ms",
          "link_bytes_per_s": "--link-mbps", "kv_bytes_per_token": "--kv-bytes-per-token",
          "kv_fixed_bytes": "--kv-fixed-bytes", "tokens_per_char": "--tokens-per-char",
          "decode_s_per_token": "--decode-ms-per-token",
          "remote_overhead_s": "--remote-overhead-ms", "alpha": "--alpha"}


def _flag_of(message: str) -> str:
    return next((f for k, f in _FLAGS.items() if message.startswith(k)), "a prior")


def run_route(args: argparse.Namespace) -> int:
    """Build and serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    server = build(args)
    serve(server, announce=lambda line: print(line, flush=True))
    return 0
