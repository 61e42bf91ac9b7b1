"""The ``kvstore`` command line: ``verify`` and ``inspect`` a store directory, ``sweep-objects``
an object tier's prefix."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.errors import KVStoreError
from kvstore.tiers.objects.lifecycle import SweepFailed


def _cmd_verify(args: argparse.Namespace) -> int:
    from kvstore.tools.verify import verify_path

    report = verify_path(args.store)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.tools.verify import inspect_path

    print(json.dumps(inspect_path(args.store), indent=2))
    return 0


def _cmd_sweep_objects(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvstore.tiers.objects import sweep_objects

    report = sweep_objects(args.url, ttl_s=args.ttl_s, max_bytes=args.max_bytes)
    print(json.dumps(asdict(report), indent=2))
    return 0


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``verify``, ``inspect`` and ``sweep-objects`` (shared with the engine's
    ``kvstore`` command)."""
    v = sub.add_parser("verify", help="re-check every checksum; non-zero exit on corruption")
    v.add_argument("store", help="store directory")
    v.set_defaults(func=_cmd_verify)
    i = sub.add_parser("inspect", help="JSON summary: layout, contexts, chunks, bytes per tier")
    i.add_argument("store", help="store directory")
    i.set_defaults(func=_cmd_inspect)
    w = sub.add_parser("sweep-objects", help="delete an object tier's values unused for the "
                                             "time-to-live, then the least recently used "
                                             "beyond a cap (JSON report)")
    w.add_argument("url", help="s3://BUCKET/PREFIX?endpoint=... (credentials: AWS_* or profile=)")
    w.add_argument("--ttl-s", type=float, default=None, help="default 7 days")
    w.add_argument("--max-bytes", type=int, default=None, help="cap on the values' bytes")
    w.set_defaults(func=_cmd_sweep_objects)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    add_store_commands(p.add_subparsers(dest="command", required=True))
    return p


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; store errors become a message and exit status 2."""
    try:
        return args.func(args)
    except (KVStoreError, FileNotFoundError, ValueError, SweepFailed) as e:
        print(f"kvstore {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
