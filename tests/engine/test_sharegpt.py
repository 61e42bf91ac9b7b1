"""The streaming ShareGPT reader on crafted JSON and on the real (truncated) file."""

import itertools

import pytest

from engine.sharegpt import (
    iter_conversations,
    iter_records,
    load_conversations,
    messages,
    token_table,
)


def test_truncated_array_yields_complete_records(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[\n {"id": "a_0", "conversations": [{"from": "human", "value": "hi"},'
                 ' {"from": "gpt", "value": "hello"}]},\n'
                 ' {"id": "b_0", "conversations": [{"from": "system", "value": "s"},'
                 ' {"from": "bing", "value": "  "}, {"from": "robot", "value": "x"},'
                 ' {"from": "chatgpt", "value": "ok"}]},\n'
                 ' {"id": "c_0", "conversations": [{"from": "hum')
    recs = list(iter_records(str(p), block=16))  # tiny blocks: records span block borders
    assert [r["id"] for r in recs] == ["a_0", "b_0"]
    assert messages(recs[1]) == [{"role": "system", "content": "s"},
                                 {"role": "assistant", "content": "ok"}]
    assert list(iter_conversations(str(p))) == [[{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]]


def test_real_file_head():
    recs = list(itertools.islice(iter_records(), 200))
    assert len(recs) == 200 and all("conversations" in r for r in recs)
    convs = list(itertools.islice(iter_conversations(), 50))
    assert all(any(m["role"] == "user" for m in c) for c in convs)


def _write(tmp_path, records, cut=True):
    import json

    text = json.dumps(records)
    if cut:  # like the real file: the array is cut off inside a last record
        text = text[:-1] + ', {"id": "zz_0", "conversations": [{"from": "hu'
    p = tmp_path / "d.json"
    p.write_text(text)
    return str(p)


def _msgs(*pairs):
    return [{"from": f, "value": v} for f, v in pairs]


def test_loader_rules_on_crafted_json(tmp_path):
    recs = [
        # split pieces, given out of order, with a reply split across the piece border
        {"id": "a_1", "conversations": _msgs(("gpt", "part two"), ("human", "q2"),
                                              ("gpt", "a2"))},
        {"id": "a_0", "conversations": _msgs(("system", "banner"), ("human", "q1"),
                                              ("gpt", "part one"))},
        # starts with the assistant, has an empty message, an odd role, a mid system banner
        {"id": "b_0", "conversations": _msgs(("gpt", "hello?"), ("user", "q1"),
                                              ("robot", "beep"), ("human", " "),
                                              ("system", "mid banner"), ("chatgpt", "a1"),
                                              ("human", "unanswered"))},
        # an enormous message cuts the conversation before it
        {"id": "c_0", "conversations": _msgs(("human", "q1"), ("bard", "a1"),
                                              ("human", "x" * 50), ("bing", "a2"))},
        # nothing complete is left
        {"id": "d_0", "conversations": _msgs(("gpt", "only me"))},
        # pieces with a gap in their numbers
        {"id": "e_0", "conversations": _msgs(("human", "q1"), ("gpt", "a1"))},
        {"id": "e_3", "conversations": _msgs(("human", "q4"), ("gpt", "a4"))},
    ]
    convs, st = load_conversations(_write(tmp_path, recs), max_message_chars=40)
    by_id = {c.id: c for c in convs}
    assert sorted(by_id) == ["a", "b", "c", "e"]
    a = by_id["a"]
    assert a.system == "banner"
    assert [(t.user, t.assistant) for t in a.turns] == [("q1", "part one\n\npart two"),
                                                         ("q2", "a2")]
    assert [(t.user, t.assistant) for t in by_id["b"].turns] == [("q1", "a1")]
    assert by_id["b"].system is None
    assert [(t.user, t.assistant) for t in by_id["c"].turns] == [("q1", "a1")]
    assert len(by_id["e"].turns) == 2
    assert a.messages(1) == [{"role": "system", "content": "banner"},
                             {"role": "user", "content": "q1"},
                             {"role": "assistant", "content": "part one\n\npart two"}]
    assert (st.records, st.conversations, st.merged_pieces, st.piece_gaps) == (7, 4, 2, 1)
    assert (st.dropped_roles, st.dropped_empty, st.merged_same_role) == (2, 1, 1)
    assert (st.dropped_leading_assistant, st.dropped_trailing_user) == (2, 1)
    assert (st.cut_enormous, st.dropped_no_turn, st.turns, st.multi_turn) == (1, 1, 6, 2)
    with pytest.raises(ValueError, match="max_message_chars"):
        load_conversations(_write(tmp_path, recs), max_message_chars=0)


def test_loader_on_the_real_file():
    """Counts of the shipped file (docs/sharegpt.md); they change only if the rules do."""
    convs, st = load_conversations()
    assert st.records == 17671
    assert st.conversations == len(convs) == 9420
    assert st.turns == 61076
    assert 0.68 < st.multi_turn / st.conversations < 0.70  # the paper counts 73% multi-turn
    assert all(c.turns and all(t.user.strip() and t.assistant.strip() for t in c.turns)
               for c in convs)
    assert len({c.id for c in convs}) == len(convs)


def test_token_table_matches_the_runtime_and_is_cached(model, tmp_path):
    import os

    from engine.generate import message_ids

    recs = [
        {"id": "a_0", "conversations": _msgs(("system", "Be brief."), ("human", "Hi"),
                                              ("gpt", "Hello!"), ("human", "Name a color."),
                                              ("gpt", "Blue."))},
        {"id": "b_0", "conversations": _msgs(("human", "2+2?"), ("gpt", "4"))},
    ]
    path = _write(tmp_path, recs)
    cache = str(tmp_path / "cache")
    t = token_table(model, path=path, cache_dir=cache)
    assert t.column("conv_id").to_pylist() == ["a", "a", "b"]
    assert t.column("turn").to_pylist() == [0, 1, 0]
    users, replies = t.column("user_ids").to_pylist(), t.column("reply_ids").to_pylist()
    tok = model.tokenizer
    assert users[0] == model.chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}])
    assert users[1] == message_ids(model, "user", "Name a color.", first=False)
    assert users[2] == model.chat_template([{"role": "user", "content": "2+2?"}])
    assert replies == [tok.encode(x, allow_special=False) for x in ("Hello!", "Blue.", "4")]
    # history of conversation a after both turns = the chat template of all its messages
    hist = users[0] + replies[0] + users[1] + replies[1]
    full = model.chat_template([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "Name a color."},
                                {"role": "assistant", "content": "Blue."}],
                               add_generation_prompt=False)
    assert full[: len(hist)] == hist
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".parquet")
    assert token_table(model, path=path, cache_dir=cache).equals(t)  # read from the cache
