"""``run_script``'s EVALSHA, packed by hiredis and sent on a pooled connection, is the
command redis-py's own ``execute_command`` sends, and answers as it does."""

from __future__ import annotations

import pytest
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from store.snapshots.redis import _packed_evalsha, connect, run_script

KEYS = ["ratchet:run:{a}:record", "ratchet:run:{a}:events"]
ARGS: list[str | bytes] = ["a 5 model 17 ", "ünïcödé", "", b"\x00\xffbytes", "x" * 7000]


def test_the_packed_evalsha_is_the_bytes_redis_py_would_send() -> None:
    # Given the arguments of a transition: text, unicode, empty, binary, one past the
    # size at which redis-py sends an argument on its own
    wire = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack(
        "EVALSHA", "f" * 40, len(KEYS), *KEYS, *ARGS
    )
    # Then hiredis packs the same bytes in one piece
    assert _packed_evalsha("f" * 40, KEYS, ARGS) == [b"".join(wire)]


def test_what_hiredis_will_not_pack_is_left_to_redis_py() -> None:
    assert _packed_evalsha("f" * 40, KEYS, ["\ud800"]) is None


def test_a_script_answers_as_through_execute_command(redis_url: str) -> None:
    client = connect(redis_url)
    script = client.register_script("return {#KEYS, ARGV[1], ARGV[4]}")
    # A server that does not know the script yet is given it (NoScriptError, then load)
    client.script_flush()
    assert run_script(script, KEYS, ARGS) == [2, b"a 5 model 17 ", ARGS[3]]
    assert run_script(script, KEYS, ARGS) == client.execute_command(
        "EVALSHA", script.sha, len(KEYS), *KEYS, *ARGS
    )
    # A script's error is redis-py's ResponseError, as before
    failing = client.register_script("return redis.error_reply('ERR no')")
    with pytest.raises(redis.exceptions.ResponseError, match="no"):
        run_script(failing, [], [])
    client.close()
