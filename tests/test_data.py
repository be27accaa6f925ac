import json

import pytest
import torch

from torchpar.config import ConfigError
from torchpar.data import FileSource, PackedWindows, StdlibSource, build_dataloader
from torchpar.tokenizer import BUILTIN, Tokenizer

TOK = Tokenizer(BUILTIN)


@pytest.fixture(scope="module")
def source():
    return StdlibSource("train", seed=0)


def batches(ds_or_loader, n):
    it = iter(ds_or_loader)
    return [next(it) for _ in range(n)]


def test_stdlib_split_is_held_out_and_deterministic(source):
    val = StdlibSource("validation", seed=0)
    assert set(source.files).isdisjoint(val.files) and len(val) > 10
    assert StdlibSource("train", seed=0).files == source.files


def test_packing_is_the_token_stream_cut_into_windows(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 20)
    (tmp_path / "b.txt").write_text("delta epsilon " * 30)
    src = FileSource(str(tmp_path / "*.txt"), "text")
    stream = TOK.encode(src[0]) + TOK.encode(src[1])
    ds = PackedWindows(src, TOK, seq_len=15, local_batch_size=1, dp_rank=0, dp_degree=1, seed=0, lanes=1)
    got = torch.cat([b[0] for b in batches(ds, len(stream) // 16)]).tolist()
    assert got == stream[: len(got)]


def test_four_ranks_disjoint_and_union_is_everything(source):
    one = PackedWindows(source, TOK, 32, 8, 0, 1, seed=0)
    whole = [tuple(w.tolist()) for b in batches(one, 3) for w in b]
    shards = []
    for r in range(4):
        ds = PackedWindows(source, TOK, 32, 2, r, 4, seed=0)
        shards.append([tuple(w.tolist()) for b in batches(ds, 3) for w in b])
    flat = [w for s in shards for w in s]
    assert len(flat) == len(set(flat)) == len(whole)
    assert set(flat) == set(whole)
    # Step k's global batch is the same windows whatever the layout.
    for step in range(3):
        assert {w for s in shards for w in s[2 * step: 2 * step + 2]} == set(whole[8 * step: 8 * step + 8])


@pytest.mark.parametrize("workers,resume_workers", [(0, 0), (2, 2), (2, 0), (0, 3)])
def test_exact_resume(source, workers, resume_workers):
    """The loader's state is the global position, whatever the worker count that saved or resumes."""
    ref = batches(build_dataloader(source, TOK, 32, 4, 1, 2, seed=0, num_workers=workers), 7)
    loader = build_dataloader(source, TOK, 32, 4, 1, 2, seed=0, num_workers=workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state["windows_consumed"] == 3 * 4 * 2
    resumed = build_dataloader(source, TOK, 32, 4, 1, 2, seed=0, num_workers=resume_workers)
    resumed.load_state_dict(state)
    rest = batches(resumed, 4)
    for a, b in zip(rest, ref[3:]):
        assert torch.equal(a, b)


def test_position_is_global_and_moves_to_another_dp_degree(source):
    two = [PackedWindows(source, TOK, 32, 2, r, 2, seed=0) for r in range(2)]
    for ds in two:
        batches(ds, 3)  # 3 steps x 4 windows
    assert two[0].state_dict() == two[1].state_dict()
    assert two[0].state_dict()["windows_consumed"] == 12
    whole = PackedWindows(source, TOK, 32, 16, 0, 1, seed=0)
    expected = [tuple(w.tolist()) for w in batches(whole, 1)[0][12:16]]
    four = [PackedWindows(source, TOK, 32, 1, r, 4, seed=0) for r in range(4)]
    got = []
    for ds in four:
        ds.load_state_dict(two[0].state_dict())
        got += [tuple(w.tolist()) for w in batches(ds, 1)[0]]
    assert got == expected


def test_file_source_errors_and_skips(tmp_path):
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": ""}) + "\n")
    (tmp_path / "empty.txt").write_text("")
    src = FileSource(f"{tmp_path}/ok.jsonl,{tmp_path}/empty.txt", "text")
    assert len(src) == 1 and src.skipped == {"empty": 2}
    (tmp_path / "nofield.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"nofield.jsonl:1: no field 'text'.*set data.text_field"):
        FileSource(str(tmp_path / "nofield.jsonl"), "text")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe bad")
    with pytest.raises(ConfigError, match="bad.txt: not valid UTF-8 at byte 3"):
        FileSource(str(tmp_path / "bad.txt"), "text")
    with pytest.raises(ConfigError, match="matches no file"):
        FileSource(str(tmp_path / "missing*.txt"), "text")
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match="notjson.jsonl:1: not a JSON object"):
        FileSource(str(tmp_path / "notjson.jsonl"), "text")


def test_hf_datasets_on_a_local_file(tmp_path):
    pytest.importorskip("datasets")
    from torchpar.data import HFSource

    rows = [{"content": f"document number {i}"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    src = HFSource(str(tmp_path / "d.jsonl"), "train", "content")
    assert len(src) == 5 and src[3] == "document number 3"
    with pytest.raises(ConfigError, match="no column 'text'"):
        HFSource(str(tmp_path / "d.jsonl"), "train", "text")
