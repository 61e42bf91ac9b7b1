"""The ``kvstore`` command line: ``verify`` and ``inspect`` a store directory."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.errors import KVStoreError


def _cmd_verify(args: argparse.Namespace) -> int:
    from kvstore.verify import verify_path

    report = verify_path(args.store)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.verify import inspect_path

    print(json.dumps(inspect_path(args.store), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="re-check every checksum; non-zero exit on corruption")
    v.add_argument("store", help="store directory")
    v.set_defaults(func=_cmd_verify)
    i = sub.add_parser("inspect", help="JSON summary: layout, contexts, chunks, bytes per tier")
    i.add_argument("store", help="store directory")
    i.set_defaults(func=_cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (KVStoreError, FileNotFoundError) as e:
        print(f"kvstore {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
