"""A process that runs greedy completions through ``KVStoreLlamaCache`` (the tests' second
process). Prompts (token id lists) come as JSON in ``--prompts``; one JSON line per completion
goes to stdout: {"i", "text", "stats"}. With ``--announce-saves`` it prints ``saving I`` as
llama-cpp-python hands the cache a context to store and ``saved I`` once that returned (the
crash test kills it in between); with ``--loop`` it repeats the prompts until killed."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.integrations.llama_cpp import KVStoreLlamaCache
from tests.support.llama_helpers import complete, make_llama


class AnnouncingCache(KVStoreLlamaCache):
    """The real cache; says when a save starts and ends."""

    turn = 0

    def __setitem__(self, key, value):
        print(f"saving {self.turn}", flush=True)
        super().__setitem__(key, value)
        print(f"saved {self.turn}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: a list of token id lists")
    p.add_argument("--gguf", default=None)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=None)
    p.add_argument("--announce-saves", action="store_true")
    p.add_argument("--loop", action="store_true")
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = make_llama(args.gguf, **({} if args.n_ctx is None else {"n_ctx": args.n_ctx}))
    cache = (AnnouncingCache if args.announce_saves else KVStoreLlamaCache)(args.store)
    llm.set_cache(cache)
    i = 0
    while True:
        for prompt in prompts:
            cache.turn = i
            llm.reset()  # evaluate from the store, not from this context's last prompt
            text, _ = complete(llm, prompt, max_tokens=args.max_tokens)
            print(json.dumps({"i": i, "text": text, "stats": cache.stats()}), flush=True)
            i += 1
        if not args.loop:
            break
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
