"""The ``kvstore`` command: store tools (verify, inspect) plus the runtime's ``chat``,
``replay``/``plan`` and ``sql``."""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

from kvstore.format.directory import Dir
from kvstore.tools.cli import add_store_commands, run

CONVERSATIONS = "conversations"
MAX_NAME_BYTES = 200  # of the escaped name: a file name stays under the usual 255-byte limit
MAX_STATE_BYTES = 64 << 20


def conversation_file(name: str) -> str:
    """The state file name of conversation ``name``: one-to-one (every byte but ASCII letters,
    digits, ``-`` and ``_`` is percent-escaped, so ``a/b``, ``a_b``, ``a?b`` and ``a b`` get four
    files). ValueError if the name is empty or too long."""
    if not isinstance(name, str) or not name:
        raise ValueError("--conversation must be a non-empty name")
    escaped = quote(name, safe="-_")  # '.', '~' and '%' escaped too: no '.'/'..', no clashes
    escaped = escaped.replace(".", "%2E").replace("~", "%7E")
    if len(escaped) > MAX_NAME_BYTES:
        raise ValueError(f"--conversation is too long: {len(escaped)} bytes once escaped, at "
                         f"most {MAX_NAME_BYTES}")
    return f"{escaped}.json"


def _load_state(conversations: Dir, file: str) -> dict | None:
    try:
        raw = conversations.read_bytes(file, limit=MAX_STATE_BYTES)
    except FileNotFoundError:
        return None
    try:
        state = json.loads(raw)
        return {"ids": [int(x) for x in state["ids"]], "namespace": state["namespace"],
                "truncations": int(state["truncations"])}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"conversation state {conversations.show(file)!r} is damaged ({e})"
                         ) from None


def _conversation_state(raw: bytes | None, vocab: int) -> dict | None:
    """A conversation's state read from Redis (untrusted): checked, or None."""
    if raw is None:
        return None
    try:
        st = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(st, dict):
        return None
    ids, ns, tr = st.get("ids"), st.get("namespace"), st.get("truncations")
    if not (isinstance(ids, list) and ids and all(type(x) is int and 0 <= x < vocab
                                                  for x in ids)):
        return None
    if not (ns is None or isinstance(ns, str)) or type(tr) is not int or tr < 0:
        return None
    return {"ids": ids, "namespace": ns, "truncations": tr}


def _cmd_chat(args: argparse.Namespace) -> int:
    import kvstore
    from engine.generate import Conversation, Generator, SamplingConfig
    from engine.model import load_model
    from engine.truncation import Truncation

    try:
        file = conversation_file(args.conversation)
    except ValueError as e:
        print(f"kvstore chat: {e}", file=sys.stderr)
        return 2
    model = load_model()
    doc = f"conversation:{args.conversation}"
    with kvstore.open(args.store, layout=model.layout, remote=args.remote) as store, \
            Dir.open_root(args.store, create=False) as root, \
            root.sub(CONVERSATIONS, create=True) as conversations:
        state = _load_state(conversations, file)
        if state is None and args.remote is not None:  # another machine's conversation?
            state = _conversation_state(store.shared_docs.get(doc), model.tokenizer.vocab_size)
        gen = Generator(model, store)
        conv = Conversation(gen, args.conversation,
                            truncation=Truncation(drop_ratio=args.drop_ratio, sink=args.sink),
                            window=args.window)
        if state is not None:
            conv.ids = state["ids"]
            conv.namespace = state["namespace"]
            conv.truncations = state["truncations"]
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
            state = {"ids": conv.ids, "namespace": conv.namespace,
                     "truncations": conv.truncations}
            conversations.atomic_write(file, json.dumps(state))
            if args.remote is not None:
                store.flush(remote=True)  # the KV first, then the state that points to it
                store.shared_docs.put(doc, json.dumps(state).encode())
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
    c.add_argument("--remote", default=None,
                   help="shared tier: redis://[:password@]host:port[/db]; a conversation "
                        "started on another machine (another --store) continues from its KV")
    c.set_defaults(func=_cmd_chat)
    from engine.relational.cli import add_commands as add_sql_commands
    from engine.replay.cli import add_commands
    from kvstore.integrations.llama_cpp.server import add_serve_command

    add_commands(sub)
    add_sql_commands(sub)
    add_serve_command(sub)
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
