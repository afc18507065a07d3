"""Text <-> ids for serving: the character codec of test models and incremental detokenisation."""

import pytest

from moeless.serving.api import ApiError, ChatMessage
from moeless.serving.codec import CharCodec, TextStream


class Utf8Bytes:
    """A byte-level codec: one token per UTF-8 byte (multi-byte characters span tokens)."""

    eos_token_id = None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_text_stream_holds_back_a_split_character():
    codec = Utf8Bytes()
    stream = TextStream(codec)
    pieces = [stream.push(t) for t in codec.encode("añb✓")]
    assert pieces == ["a", "", "ñ", "b", "", "", "✓"]
    assert "".join(pieces) == "añb✓"


def test_char_codec_round_trip_and_clear_error_outside_its_alphabet():
    codec = CharCodec(128)
    assert codec.decode(codec.encode("Hi there")) == "Hi there"
    assert codec.decode(codec.chat_prompt([ChatMessage("user", "yo")])) == "user: yo\nassistant: "
    with pytest.raises(ApiError) as info:
        codec.encode("café")
    assert info.value.status == 400 and "'é'" in info.value.message
