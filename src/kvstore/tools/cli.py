"""The ``kvstore`` command line: ``verify`` and ``inspect`` a store directory."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.errors import KVStoreError


def _cmd_verify(args: argparse.Namespace) -> int:
    from kvstore.tools.verify import verify_path

    report = verify_path(args.store)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.tools.verify import inspect_path

    print(json.dumps(inspect_path(args.store), indent=2))
    return 0


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``verify`` and ``inspect`` (shared with the engine's ``kvstore`` command)."""
    v = sub.add_parser("verify", help="re-check every checksum; non-zero exit on corruption")
    v.add_argument("store", help="store directory")
    v.set_defaults(func=_cmd_verify)
    i = sub.add_parser("inspect", help="JSON summary: layout, contexts, chunks, bytes per tier")
    i.add_argument("store", help="store directory")
    i.set_defaults(func=_cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    add_store_commands(p.add_subparsers(dest="command", required=True))
    return p


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; store errors become a message and exit status 2."""
    try:
        return args.func(args)
    except (KVStoreError, FileNotFoundError) as e:
        print(f"kvstore {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
