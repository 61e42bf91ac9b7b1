"""The ``kvstore`` command line: ``verify`` and ``inspect`` a store directory, ``sweep-objects``
an object tier's prefix; ``ls`` its contexts, ``pin``/``unpin`` one, ``delete`` one or a
namespace (retention hints, see docs/store.md)."""

from __future__ import annotations

import argparse
import json
import os
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


def _open(args: argparse.Namespace, *, readonly: bool = False):
    from kvstore.store.opening import open_store

    if not readonly and not os.path.isdir(os.path.join(args.store, "catalog")):
        raise FileNotFoundError(f"no kvstore at {args.store!r}")
    shared = {k: v for k in ("remote", "objects") if (v := getattr(args, k, None)) is not None}
    return open_store(args.store, readonly=readonly, **shared)


def _tokens_file(path: str) -> list[int]:
    """Token ids from a file: a JSON list of ints, or ints separated by white space."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in
                                                                       text.split()]
    except ValueError as e:
        raise ValueError(f"--tokens-file {path!r}: not a JSON list of ints nor ints separated "
                         f"by white space ({e})") from None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(f"--tokens-file {path!r}: a JSON list of ints is expected")
    return ids


def _key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise ValueError(f"--key must be a context key as `kvstore ls` prints it (32 hex "
                         f"digits), got {text!r}")
    return key


def _target(store, args: argparse.Namespace) -> list[int]:
    """The tokens of the context ``--tokens-file`` or ``--key`` names, in ``--namespace``."""
    if args.tokens_file is not None:
        return _tokens_file(args.tokens_file)
    key = _key(args.key)
    if all(c.key != key for c in store.retention.list_contexts(args.namespace)):
        if all(c.key != key for c in store.retention.list_contexts()):
            raise KeyError(f"no context {key.hex()} is stored")
        where = "the default namespace" if args.namespace is None \
            else f"namespace {args.namespace!r}"
        raise ValueError(f"context {key.hex()} is not in {where}: give its namespace with "
                         f"--namespace")
    return store.retention.context_tokens(key).tolist()


def _line(c, now: float) -> str:
    """One ``ls`` line: key, namespace, tokens, disk bytes, pin."""
    if not c.named:
        ns = f"#{c.seed[:4].hex()}"  # its name is not stored: the start of its chain seed
    else:
        ns = "(default)" if c.namespace is None else json.dumps(c.namespace)
    if c.pin is None:
        pin = "unpinned"
    elif c.pin.expires is None:
        pin = "pinned"
    else:
        pin = f"pinned ttl={max(0.0, c.pin.expires - now):.1f}s"
    return f"{c.key.hex()}  namespace={ns}  tokens={c.n_tokens}  bytes={c.nbytes}  {pin}"


def _cmd_ls(args: argparse.Namespace) -> int:
    with _open(args, readonly=True) as s:
        retention = s.retention
        infos = retention.list_contexts(args.namespace) if args.namespace_given \
            else retention.list_contexts()
        now = s.debug.wall_clock()
        for c in infos:
            print(_line(c, now))
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    with _open(args) as s:
        rec = s.retention.pin(_target(s, args), namespace=args.namespace, ttl_s=args.ttl)
        (c,) = [c for c in s.retention.list_contexts(args.namespace) if c.key == rec.key]
        print(_line(c, s.debug.wall_clock()))
    return 0


def _cmd_unpin(args: argparse.Namespace) -> int:
    with _open(args) as s:
        toks = _target(s, args)
        print("unpinned" if s.retention.unpin(toks, namespace=args.namespace) else "was not pinned")
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    with _open(args) as s:
        if args.key is None and args.tokens_file is None:
            if not args.namespace_given:
                raise ValueError("delete needs --key, --tokens-file or --namespace")
            n = s.retention.delete(namespace=args.namespace)
        else:
            n = int(s.retention.delete(_target(s, args), namespace=args.namespace))
        print(f"deleted {n} context{'s' if n != 1 else ''}")
    return 0


class _Namespace(argparse.Action):
    """``--namespace NS``; records that it was given (the default namespace is None)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.namespace = values
        namespace.namespace_given = True


def _target_options(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--key", help="the context's key, as `kvstore ls` prints it")
    g.add_argument("--tokens-file", help="the context's token ids: a JSON list, or ints "
                                         "separated by white space")
    p.add_argument("--namespace", action=_Namespace, default=None,
                   help="the context's namespace (default: the default namespace)")
    p.set_defaults(namespace_given=False)


def _add_retention_commands(sub: argparse._SubParsersAction) -> None:
    ls = sub.add_parser("ls", help="one line per stored context: key, namespace, tokens, "
                                   "disk bytes, pin")
    ls.add_argument("store", help="store directory")
    ls.add_argument("--namespace", action=_Namespace, default=None,
                    help="only this namespace's contexts")
    ls.set_defaults(func=_cmd_ls, namespace_given=False)
    pin = sub.add_parser("pin", help="keep a context on disk until unpinned (or for --ttl s)")
    pin.add_argument("store", help="store directory")
    _target_options(pin)
    pin.add_argument("--ttl", type=float, default=None, help="seconds (default: until unpin)")
    pin.set_defaults(func=_cmd_pin)
    un = sub.add_parser("unpin", help="let a pinned context be evicted again")
    un.add_argument("store", help="store directory")
    _target_options(un)
    un.set_defaults(func=_cmd_unpin)
    de = sub.add_parser("delete", help="delete a context (--key, --tokens-file) or every "
                                       "context of a namespace (--namespace alone)")
    de.add_argument("store", help="store directory")
    _target_options(de, required=False)
    de.add_argument("--remote", default=None, help="also delete from this Redis tier")
    de.add_argument("--objects", default=None, help="also delete from this object tier")
    de.set_defaults(func=_cmd_delete)


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``verify``, ``inspect``, ``sweep-objects``, ``ls``, ``pin``, ``unpin``,
    ``delete`` and ``route`` (shared with the engine's ``kvstore`` command)."""
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
    w.add_argument("--ttl-s", type=float, default=None,
                   help="seconds a value may stay unused (default 7 days; 0: every value "
                        "now)")
    w.add_argument("--max-bytes", type=int, default=None, help="cap on the values' bytes")
    w.set_defaults(func=_cmd_sweep_objects)
    _add_retention_commands(sub)
    from kvstore.tools.router.command import add_route_command

    add_route_command(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    add_store_commands(p.add_subparsers(dest="command", required=True))
    return p


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; store errors become a message and exit status 2."""
    try:
        return args.func(args)
    except (KVStoreError, FileNotFoundError, ValueError, KeyError, SweepFailed) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kvstore {args.command}: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
