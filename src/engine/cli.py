"""The ``kvstore`` command: store tools (verify, inspect) plus the runtime's ``chat``,
``replay``/``plan`` and ``sql``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvstore.cli import add_store_commands, run
from kvstore.fsutil import atomic_write


def _conversation_path(store_dir: str, name: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return os.path.join(store_dir, "conversations", f"{safe}.json")


def _save_json_atomic(path: str, obj: object) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, json.dumps(obj))


def _cmd_chat(args: argparse.Namespace) -> int:
    import kvstore
    from engine.generate import Conversation, Generator, SamplingConfig
    from engine.model import load_model
    from kvstore.truncation import Truncation

    model = load_model()
    state_path = _conversation_path(args.store, args.conversation)
    state = None
    if os.path.exists(state_path):
        with open(state_path) as f:
            state = json.load(f)
    with kvstore.open(args.store, layout=model.layout) as store:
        gen = Generator(model, store)
        conv = Conversation(gen, args.conversation,
                            truncation=Truncation(drop_ratio=args.drop_ratio, sink=args.sink),
                            window=args.window)
        if state is not None:
            conv.ids = [int(x) for x in state["ids"]]
            conv.namespace = state["namespace"]
            conv.truncations = int(state["truncations"])
            print(f"[continuing conversation {args.conversation!r}: {len(conv.ids)} tokens of "
                  f"history, {store.match(conv.ids, namespace=conv.namespace)} stored]",
                  flush=True)
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            before = conv.truncations
            reply, r = conv.turn(text, args.max_new_tokens, sampling=sampling)
            print(f"assistant> {reply}", flush=True)
            note = "; history truncated" if conv.truncations > before else ""
            print(f"[reused {r.reused_tokens} tokens, prefilled {r.prefilled_tokens}, "
                  f"TTFT {r.ttft_s * 1000:.0f} ms, {len(r.tokens)} tokens generated{note}]",
                  flush=True)
            _save_json_atomic(state_path, {"ids": conv.ids, "namespace": conv.namespace,
                                           "truncations": conv.truncations})
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    add_store_commands(sub)
    c = sub.add_parser("chat", help="interactive multi-turn chat whose history lives in the store")
    c.add_argument("--store", required=True, help="store directory (created if missing)")
    c.add_argument("--conversation", default="default",
                   help="conversation name; run again with the same name to continue it")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--window", type=int, default=None,
                   help="context window in tokens (default: the model's)")
    c.add_argument("--drop-ratio", type=float, default=0.5,
                   help="fraction of history dropped on overflow")
    c.add_argument("--sink", type=int, default=4, help="first tokens always kept on truncation")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.set_defaults(func=_cmd_chat)
    from engine.relational.cli import add_commands as add_sql_commands
    from engine.replay.cli import add_commands

    add_commands(sub)
    add_sql_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # a bad option value: the message names it
        print(f"kvstore {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
