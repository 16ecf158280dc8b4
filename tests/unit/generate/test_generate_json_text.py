"""JSON of the generation step: orjson's speed, the standard library's precision about bad text."""

from __future__ import annotations

import json

import pytest

from pipeline.steps.generate.json_text import loads, not_unicode, utf8_json


def test_a_lone_surrogate_is_read_and_then_refused_with_where_it_is():
    line = json.dumps({"id": "a", "content": "lone \ud800 surrogate"})  # the escape \ud800: valid JSON
    row = loads(line)  # orjson refuses it; the standard library reads it
    assert row["content"] == "lone \ud800 surrogate"
    with pytest.raises(UnicodeEncodeError) as caught:
        utf8_json(row)
    assert not_unicode(caught.value) == 'lone surrogate U+D800 after \'{"id": "a", "content": "lone \''


def test_what_orjson_cannot_write_falls_back_and_garbage_is_a_value_error():
    assert json.loads(utf8_json({"n": 2**70, "t": "é"})) == {"n": 2**70, "t": "é"}
    assert utf8_json({"t": "é"}) == '{"t":"é"}'.encode()
    with pytest.raises(ValueError):
        loads(b'{"id": "a", "content": ')
