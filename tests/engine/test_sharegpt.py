"""The streaming ShareGPT reader on crafted JSON and on the real (truncated) file."""

import itertools

from engine.sharegpt import iter_conversations, iter_records, messages


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
