"""The wire format's pieces that need no server: the streamed text of a reply (`TextDeltas`)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from peft_kvcache.serving.openai_api import TextDeltas  # noqa: E402


class CountingTokenizer(PreTrainedTokenizerFast):
    """A byte-level tokenizer with one token per byte (multi-byte characters span several tokens) that records how
    many ids each decode call is given."""

    decoded: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return super().decode(ids, **kwargs)


def byte_tokenizer() -> CountingTokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(["[UNK]"] + sorted(alphabet))}, merges=[],
                                   unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = CountingTokenizer(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.decoded = []
    return tokenizer


def stream(text: str, stop=()) -> tuple[TextDeltas, list[str], CountingTokenizer]:
    tokenizer = byte_tokenizer()
    pieces = []
    deltas = TextDeltas(tokenizer, stop, emit=pieces.append)
    deltas.put([0])  # the prompt
    for token in tokenizer(text).input_ids:
        deltas.put([token])
    deltas.end()
    return deltas, pieces, tokenizer


def test_pieces_add_up_to_the_reply_and_never_split_a_character():
    text = "naïve café — 日本語 ✓ " * 20
    deltas, pieces, _ = stream(text)
    assert "".join(pieces) == deltas.text == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_each_token_decodes_a_short_window_not_the_whole_reply():
    text = "déjà vu " * 200  # 1,800 bytes, one token each
    _, _, tokenizer = stream(text)
    assert max(tokenizer.decoded) <= 8  # a character's bytes and the context before them
    assert sum(tokenizer.decoded) < 6 * len(text.encode())


@pytest.mark.parametrize("stop", ["END", "é—", "\n\n"])
def test_a_stop_string_cuts_the_text_and_its_beginning_is_never_sent(stop):
    text = f"some text é— and {stop} what must not be sent"
    deltas, pieces, _ = stream(text, [stop])
    assert deltas.stop_hit and deltas.text == text[: text.index(stop)] == "".join(pieces)
