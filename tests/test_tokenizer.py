import pytest

from torchpar.tokenizer import BUILTIN, Tokenizer, TokenizerError, load_bpe_ranks, save_bpe_ranks, train_bpe


def test_round_trip_and_specials():
    tok = Tokenizer(BUILTIN)
    assert tok.n_words == 4096 and (tok.bos_id, tok.eos_id) == (4094, 4095)
    text = "def f(x):\n    return x * 2  # ünïcode ✓ <|end_of_text|>"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.eos_id not in ids[1:-1]  # special text inside a document stays text
    assert tok.decode(ids[1:-1]) == text
    code = "    def forward(self, x):\n        return self.linear(x)\n"
    assert len(tok.encode(code, bos=False, eos=False)) < len(code) / 3  # it compresses Python


def test_trainer_learns_merges_deterministically(tmp_path):
    texts = ["hello hello hello world", "hello there"] * 5
    a, b = train_bpe(texts, 270), train_bpe(texts, 270)
    assert a == b and len(a) == 270 and b" hello" in a
    save_bpe_ranks(a, tmp_path / "t.tiktoken")
    tok = Tokenizer(tmp_path / "t.tiktoken")
    assert tok.decode(tok.encode("hello world", bos=False, eos=False)) == "hello world"
    assert len(tok.encode(" hello", bos=False, eos=False)) == 1


@pytest.mark.parametrize("content, message", [(None, "not found"), ("", "empty"),
                                              ("!!notbase64 0\n", "not 'base64 rank'"),
                                              ("YQ== 0 extra\n", "expected 'base64 rank'"),
                                              ("YQ== 0\nYg== 5\n", "ranks must be exactly"),
                                              ("YQ== 0\nYg== 1\n", "needs all 256 single bytes")])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenizerError, match=message):
        load_bpe_ranks(path)
