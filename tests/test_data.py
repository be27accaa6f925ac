import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import ROOT, TINY, cli
from test_train import env

from torchpar.config import load_config
from torchpar.data import (
    DocumentSource,
    FileSource,
    PackedWindows,
    StdlibSource,
    TokenizedCorpus,
    build_dataloader,
    document_ids,
)
from torchpar.data.streams import Mixture
from torchpar.data.tokenized import MANIFEST, prepare, verify_prepared
from torchpar.errors import ConfigError
from torchpar.models import adapter, model_args
from torchpar.tokenizer import BUILTIN, Tokenizer

TOK = Tokenizer(BUILTIN)


@pytest.fixture(scope="module")
def stdlib():
    return StdlibSource("train", seed=0)


@pytest.fixture(scope="module")
def prepared(stdlib, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepared")
    prepare(stdlib, TOK, folder, processes=2, docs_per_shard=64, quiet=True)
    return TokenizedCorpus(str(folder))


@pytest.fixture(scope="module", params=["text", "tokenized"])
def source(request, stdlib, prepared):
    """The stdlib corpus read both ways: every loader property holds for both readers."""
    return stdlib if request.param == "text" else prepared


class ListSource(DocumentSource):
    """Documents from a list, empty ones included (the stdlib has a few files that read as empty)."""

    def __init__(self, docs):
        super().__init__("list")
        self.docs = docs

    def fingerprint(self) -> str:
        return f"{len(self.docs)} documents"

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> str:
        return self.docs[i]


def batches(ds_or_loader, n):
    it = iter(ds_or_loader)
    return [next(it) for _ in range(n)]


def test_stdlib_split_is_held_out_and_deterministic(stdlib):
    val = StdlibSource("validation", seed=0)
    assert set(stdlib.files).isdisjoint(val.files) and len(val) > 10
    assert StdlibSource("train", seed=0).files == stdlib.files


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
    resumed.state_dict()  # as the checkpointer does before loading: must not pin the old position
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


# ---------------------------------------------------------------- prepared corpora


def folder_bytes(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def prepare_cli(tmp_path, out, *more):
    r = cli(["prepare-data", "--config", str(TINY), "--out", str(out), *more], env(tmp_path))
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


@pytest.mark.slow
def test_prepare_data_is_deterministic_and_resumable(tmp_path):
    """The same bytes whatever the number of processes; an interrupted preparation (shards without
    their commit file, no manifest) redoes only what is missing and ends with the same bytes."""
    one, two = tmp_path / "one", tmp_path / "two"
    out = prepare_cli(tmp_path, one, "--processes", "1", "--docs-per-shard", "200")
    assert "1,731 documents" in out or "documents" in out
    prepare_cli(tmp_path, two, "--processes", "2", "--docs-per-shard", "200")
    whole = folder_bytes(one)
    assert whole == folder_bytes(two) and len([n for n in whole if n.endswith(".bin")]) > 2
    for name in ("manifest.json", "shard-00001.json", "shard-00003.json"):
        (two / name).unlink()
    (two / "shard-00003.bin").write_bytes(b"half a shard")
    shards = len([n for n in whole if n.endswith(".bin")])
    out = prepare_cli(tmp_path, two, "--processes", "2", "--docs-per-shard", "200")
    assert f"resuming, {shards - 2} of {shards} shards already written" in out
    assert folder_bytes(two) == whole
    manifest = json.loads((one / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["documents"] == StdlibSource("train", 0).fingerprint()


def test_prepare_an_hf_dataset_and_detect_a_prepared_folder(tmp_path):
    """A Hugging Face dataset (a local JSON-lines file through its builder) prepares like any
    source; a prepared folder named under data.dataset = 'files' is read as prepared."""
    pytest.importorskip("datasets")
    from torchpar.data import HFSource, build_source

    rows = [{"content": f"def f{i}(x):\n    return x + {i}\n" * (i % 5 + 1)} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = HFSource(str(tmp_path / "d.jsonl"), "train", "content")
    prepare(src, TOK, tmp_path / "p", processes=2, docs_per_shard=16, quiet=True)
    cfg = load_config(None, ["--data.dataset", "files", "--data.path", str(tmp_path / "p")]).data
    corpus = build_source(cfg, seed=0)
    assert isinstance(corpus, TokenizedCorpus) and corpus.fingerprint() == src.fingerprint()
    text, tokens = (batches(PackedWindows(s, TOK, 16, 4, 0, 1, seed=0, lanes=8), 20) for s in (src, corpus))
    assert all(torch.equal(a, b) for a, b in zip(text, tokens))


def test_prepared_windows_equal_text_windows(stdlib, prepared):
    """Same corpus, same tokenizer: the pre-tokenized reader yields the text reader's windows and
    positions, batch for batch, on every rank."""
    for dp, rank in ((1, 0), (4, 3)):
        text = PackedWindows(stdlib, TOK, 64, 2, rank, dp, seed=0)
        tokens = PackedWindows(prepared, TOK, 64, 2, rank, dp, seed=0)
        for a, b in zip(batches(text, 12), batches(tokens, 12)):
            assert torch.equal(a, b)
        assert text.with_lanes(text.state_dict()) == tokens.with_lanes(tokens.state_dict())


@pytest.mark.parametrize("lanes,seq_len", [(3, 15), (7, 4), (1, 40), (5, 9)])
def test_prepared_windows_across_epochs_and_empty_documents(tmp_path, lanes, seq_len):
    """Many epochs of a small corpus with empty documents: windows and every lane's position agree."""
    rng = random.Random(lanes)
    docs = [" ".join(f"w{rng.randint(0, 99)}" for _ in range(rng.randint(1, 30))) if i % 4 else ""
            for i in range(30)]
    src = ListSource(docs)
    prepare(src, TOK, tmp_path, processes=1, docs_per_shard=7, quiet=True)
    corpus = TokenizedCorpus(str(tmp_path))
    assert (corpus.lengths == 0).sum() == 8
    text, tokens = (PackedWindows(s, TOK, seq_len, 2, 1, 2, seed=5, lanes=lanes) for s in (src, corpus))
    it_text, it_tokens = iter(text), iter(tokens)
    for _ in range(60):
        assert torch.equal(next(it_text), next(it_tokens))
        assert text.with_lanes(text.state_dict()) == tokens.with_lanes(tokens.state_dict())
    assert min(lane[0] for lane in text.state_dict()["sources"][0]["lanes"]) >= 1  # every lane past an epoch


def test_a_lane_with_only_empty_documents_skips_the_epoch(tmp_path):
    """More lanes than documents: a lane whose one document is empty goes on to its next epoch,
    alike in both readers; a corpus with no token at all is one error, never a wait."""
    src = ListSource(["alpha beta gamma", "", "delta epsilon", " "])
    prepare(src, TOK, tmp_path / "p", processes=1, docs_per_shard=3, quiet=True)
    corpus = TokenizedCorpus(str(tmp_path / "p"))
    text, tokens = (PackedWindows(s, TOK, 6, 4, 0, 1, seed=1, lanes=6) for s in (src, corpus))
    for a, b in zip(batches(text, 30), batches(tokens, 30)):
        assert torch.equal(a, b)
    assert text.with_lanes(text.state_dict()) == tokens.with_lanes(tokens.state_dict())
    empty = ListSource(["", " \n"])
    prepare(empty, TOK, tmp_path / "e", processes=1, docs_per_shard=3, quiet=True)
    for source in (empty, TokenizedCorpus(str(tmp_path / "e"))):
        with pytest.raises(ConfigError, match="list: its documents are all empty"):
            batches(PackedWindows(source, TOK, 8, 8, 0, 1, seed=0), 1)


class LoggedSource(ListSource):
    """Records, per process, which documents it was asked for."""

    def __init__(self, docs, folder: Path):
        super().__init__(docs)
        self.folder = folder

    def __getitem__(self, i: int) -> str:
        with open(self.folder / f"{os.getpid()}.log", "a") as f:
            f.write(f"{i}\n")
        return super().__getitem__(i)


def test_workers_split_the_lanes(tmp_path):
    """Two loader workers each tokenize only their own lanes: no document is read twice, and the
    batches are those of the loader without workers."""
    rng = random.Random(0)
    docs = [" ".join(f"w{rng.randint(0, 99)}" for _ in range(rng.randint(5, 40))) for _ in range(200)]
    ref = batches(build_dataloader(ListSource(docs), TOK, 16, 4, 1, 2, seed=0, lanes=8), 10)
    logs = tmp_path / "logs"
    logs.mkdir()
    loader = build_dataloader(LoggedSource(docs, logs), TOK, 16, 4, 1, 2, seed=0, lanes=8, num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(batches(loader, 10), ref))
    read = [[int(x) for x in f.read_text().split()] for f in logs.iterdir()]
    assert len(read) == 2 and not set(read[0]) & set(read[1])
    assert all(len(r) == len(set(r)) for r in read)  # each document tokenized once


def test_a_position_carries_over_between_readers(stdlib, prepared):
    """A position saved by one reader resumes in the other: the same windows follow."""
    ref = batches(build_dataloader(stdlib, TOK, 32, 4, 0, 2, seed=0), 6)
    for first, second in ((stdlib, prepared), (prepared, stdlib)):
        loader = build_dataloader(first, TOK, 32, 4, 0, 2, seed=0)
        batches(loader, 3)
        resumed = build_dataloader(second, TOK, 32, 4, 0, 2, seed=0)
        resumed.load_state_dict(loader.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(batches(resumed, 3), ref[3:]))


def test_a_new_sequence_length_goes_on_from_each_lanes_position(tmp_path):
    """A resume with a longer seq_len: each lane goes on from its saved document and token, alike
    in both readers (the prepared one must not count windows of the new length from the start)."""
    rng = random.Random(2)
    docs = [" ".join(f"w{rng.randint(0, 99)}" for _ in range(rng.randint(1, 40))) for _ in range(30)]
    src = ListSource(docs)
    prepare(src, TOK, tmp_path, processes=1, docs_per_shard=8, quiet=True)
    corpus = TokenizedCorpus(str(tmp_path))
    before = build_dataloader(src, TOK, 8, 2, 0, 1, seed=3, lanes=3)
    batches(before, 25)  # past the first epoch of some lanes
    state = before.state_dict()
    after = [build_dataloader(s, TOK, 16, 2, 0, 1, seed=3, lanes=3) for s in (src, corpus)]
    for loader in after:
        loader.load_state_dict(state)
    text, tokens = (batches(loader, 20) for loader in after)
    assert all(torch.equal(a, b) for a, b in zip(text, tokens))
    assert after[0].state_dict() == after[1].state_dict()


def test_mixture_weights_too_small_are_one_error():
    assert Mixture([1, 2]).counts == [1, 2]
    assert Mixture([1e-5, 2e-5]).counts == [1, 2]
    with pytest.raises(ConfigError, match="each must be at least 1/10000 of their sum"):
        Mixture([1, 1e-5])


def test_resharded_prepared_stream_sees_every_window_once(prepared):
    """dp 4 with no workers for 3 steps, then dp 2 with 2 workers for 3 more: the windows trained
    on are exactly the first 6 global batches of one rank alone, none twice."""
    def rows(loader, n):
        return [tuple(w.tolist()) for b in batches(loader, n) for w in b]

    one = rows(build_dataloader(prepared, TOK, 32, 8, 0, 1, seed=0), 6)
    four = [build_dataloader(prepared, TOK, 32, 2, r, 4, seed=0) for r in range(4)]
    seen = [w for loader in four for w in rows(loader, 3)]
    state = four[0].state_dict()
    assert all(loader.state_dict() == state for loader in four) and state["windows_consumed"] == 24
    two = [build_dataloader(prepared, TOK, 32, 4, r, 2, seed=0, num_workers=2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
        seen += rows(loader, 3)
    assert len(seen) == len(set(seen)) == 48 and set(seen) == set(one)


def test_mixture_is_exact_and_the_same_under_any_layout(tmp_path, prepared):
    """70/30 of a prepared and a text source: exactly 7 of every 10 windows from the first, each
    source's windows in its own order, the same global batches under dp 1 and dp 2, and the tokens
    read per source counted in the position."""
    mix = Mixture([0.7, 0.3])
    assert (mix.period, mix.counts) == (10, [7, 3])
    assert [mix.before(g) for g in (10, 40, 1000)] == [[7, 3], [28, 12], [700, 300]]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"})
                                                 + "\n" for i in range(50)))
    code = FileSource(str(tmp_path / "code.jsonl"), "text")

    def global_batches(dp, steps):
        loaders = [PackedWindows([prepared, code], TOK, 16, 10 // dp, r, dp, seed=0, weights=[0.7, 0.3])
                   for r in range(dp)]
        return [torch.cat(group) for group in zip(*(batches(ld, steps) for ld in loaders))], loaders[0]

    one, loader = global_batches(1, 4)
    two, _ = global_batches(2, 4)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    rows = torch.cat(one)  # the first 40 global windows
    alone = [torch.cat(batches(PackedWindows(s, TOK, 16, n, 0, 1, seed=0), 1))
             for s, n in ((prepared, 28), (code, 12))]
    which = [mix.locate(g)[0] for g in range(40)]
    assert which.count(1) == 12
    for s in (0, 1):
        assert torch.equal(rows[[g for g in range(40) if which[g] == s]], alone[s])
    state = loader.state_dict()
    assert state["windows_consumed"] == 40 and state["source_tokens"] == [28 * 16, 12 * 16]


def test_document_masking_packed_equals_documents_alone():
    """A packed window (starting inside a document) under document masking gives each token the
    logits of its document run alone, from position 0; without masking it does not."""
    docs = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())", "class A:\n    pass\n" * 3]
    ids = [TOK.encode(d) for d in docs]
    window = torch.tensor([sum(ids, [])[3:]])
    pieces = [ids[0][3:], ids[1], ids[2]]
    for family in ("llama3", "gpt2"):
        cfg = load_config(None, ["--model.name", family])
        model = adapter(family).build(model_args(cfg.model))
        model.init_weights(0)
        with torch.no_grad():
            masked = model(window, documents=document_ids(window, TOK.bos_id))[0]
            alone = torch.cat([model(torch.tensor([p]))[0] for p in pieces])
            plain = model(window)[0]
        assert (masked - alone).abs().max() < 1e-5, family
        assert (plain - alone).abs().max() > 1e-2, family


def test_document_attention_per_document_equals_the_mask(monkeypatch):
    """Attention run document by document (causal kernel calls) gives the logits and gradients of
    one masked call over the window, for both families (Llama's grouped-query heads too), rows
    holding one to many documents; a compiled block takes new spans without being traced again."""
    from torchpar.models import common

    rows = torch.tensor([[0] * 32, [0] * 5 + [1] * 20 + [2] * 7, [3] * 9 + [4] * 23, [5, 6, 7, 8] * 8])
    documents = rows.sort(dim=1).values  # non-decreasing along each row, as packed windows are
    tokens = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
    for family in ("llama3", "gpt2"):
        model = adapter(family).build(model_args(load_config(None, ["--model.name", family]).model))
        model.init_weights(0)
        results = []
        for most in (common.PER_DOCUMENT_MAX, 0):  # spans, then the dense mask
            monkeypatch.setattr(common, "PER_DOCUMENT_MAX", most)
            kind = type(common.document_layout(documents, torch.float32, torch.device("cpu"))[1])
            assert (kind is common.DocumentSpans) == (most > 0)
            model.zero_grad()
            logits = model(tokens, documents=documents)
            logits.square().mean().backward()
            results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        (a, grads_a), (b, grads_b) = results
        assert (a - b).abs().max() < 1e-5, family
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(grads_a, grads_b)), family

    from torch._dynamo.utils import counters

    monkeypatch.undo()
    block = model.layers["0"]  # GPT-2's: it takes the hidden states and the mask
    compiled = torch.compile(block, backend="eager")
    h = torch.randn(4, 32, model.args.dim)
    for shift in range(3):  # other documents every batch
        spans = common.document_layout((documents + torch.arange(32) // (9 + shift)).cummax(1).values,
                                       torch.float32, torch.device("cpu"))[1]
        assert isinstance(spans, common.DocumentSpans)
        assert torch.allclose(compiled(h, spans), block(h, spans), atol=1e-6)
        if shift == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


# ---------------------------------------------------------------- in the trainer


def train(tmp_path, folder, *overrides, config=TINY):
    r = cli(["train", "--config", str(config), "--job.dump_folder", str(folder), "--checkpoint.enable",
             "true", "--checkpoint.interval", "2", "--checkpoint.async_mode", "off", *overrides],
            env(tmp_path))
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_trainer_reads_prepared_data_and_resumes_across_readers(tmp_path, prepared):
    """A run on the prepared corpus has the text run's losses; a text run's checkpoint resumes on
    the prepared corpus (the same data position) and ends where the uninterrupted run ends."""
    tokenized = ["--data.dataset", "tokenized", "--data.path", str(prepared.folder)]
    text = losses(train(tmp_path, tmp_path / "text", "--training.steps", "4"))
    assert losses(train(tmp_path, tmp_path / "tok", "--training.steps", "4", *tokenized)) == text
    train(tmp_path, tmp_path / "switch", "--training.steps", "2")
    resumed = losses(train(tmp_path, tmp_path / "switch", "--training.steps", "4", *tokenized))
    assert resumed[4] == text[4]


@pytest.mark.slow
def test_trainer_logs_and_checkpoints_tokens_per_source(tmp_path, prepared):
    """A 3:1 mixture: tokens read per source logged at every step, in the proportion of the weights,
    and restored from a checkpoint (a resumed run counts on from the saved figures)."""
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"})
                                                 + "\n" for i in range(50)))
    mix = tmp_path / "mix.toml"
    mix.write_text(f'extends = "{TINY}"\n[[data.sources]]\nname = "web"\nweight = 3\n'
                   f'dataset = "tokenized"\npath = "{prepared.folder}"\n'
                   f'[[data.sources]]\nname = "code"\nweight = 1\ndataset = "files"\n'
                   f'path = "{tmp_path}/code.jsonl"\n')
    whole = train(tmp_path, tmp_path / "whole", "--training.steps", "4", config=mix)
    last = [r for r in whole if r.get("step") == 4 and "loss" in r][0]
    assert (last["tokens_seen/web"], last["tokens_seen/code"]) == (24 * 32, 8 * 32)  # 4 steps x 8 windows
    train(tmp_path, tmp_path / "half", "--training.steps", "2", config=mix)
    again = train(tmp_path, tmp_path / "half", "--training.steps", "4", config=mix)
    resumed = [r for r in again if r.get("step") == 4 and "loss" in r][0]
    assert resumed["tokens_seen/web"] == last["tokens_seen/web"] and resumed["loss"] == last["loss"]


# ---------------------------------------------------------------- prepare-data: outputs and edge cases


def prepare_in_process(capfd, tmp_path, out, *more, corpus=None) -> tuple[int, str]:
    """``torchpar prepare-data`` of a small JSON-lines corpus, in this process: (exit code, stderr)."""
    from torchpar.commands import main

    if corpus is None:
        corpus = tmp_path / "c.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                                  for i in range(40)))
    capfd.readouterr()
    code = main(["prepare-data", "--config", str(TINY), "--out", str(out), "--processes", "1",
                 "--docs-per-shard", "16", "--data.dataset", "files", "--data.path", str(corpus), *more])
    return code, capfd.readouterr().err


def test_prepare_data_never_writes_among_other_files(tmp_path, capfd):
    """A folder holding a user's manifest.json is refused before any work and left byte for byte as
    it was (no shard written beside it); --overwrite writes there; running again into the corpus's own
    folder resumes without --overwrite."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"mine": true}\n')
    before = folder_bytes(out)
    code, err = prepare_in_process(capfd, tmp_path, out)
    assert code == 2 and "--out" in err and "--overwrite" in err and "Traceback" not in err
    assert folder_bytes(out) == before
    code, err = prepare_in_process(capfd, tmp_path, out, "--overwrite")
    assert code == 0, err
    assert TokenizedCorpus(str(out)).manifest["n_documents"] == 40
    (out / "manifest.json").unlink()  # as an interrupted run leaves it: its own prepare.json is there
    (out / "shard-00001.json").unlink()
    code, err = prepare_in_process(capfd, tmp_path, out)
    assert code == 0 and "resuming, 2 of 3 shards already written" in err, err


@pytest.mark.slow
def test_prepare_data_interrupted_is_one_line_and_resumes(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops every process with
    one line and no traceback; the same command then goes on from the shards written."""
    out = tmp_path / "p"
    # The Ctrl-C comes from the worker that has just written shard 1 (the workers are forked, so
    # they run this patch): a whole preparation takes a second or two, and a test that polls for
    # that shard was starved on a loaded machine until the run had finished.
    ctrl_c_after_shard_1 = (
        "import os, signal, sys\n"
        # A shell without job control starts a background command with SIGINT ignored, and Python
        # then never raises KeyboardInterrupt; a terminal's foreground command has the default.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from torchpar.data import tokenized\n"
        "write = tokenized._write_json\n"
        "def write_then_ctrl_c(path, data):\n"
        "    write(path, data)\n"
        "    if path.name == 'shard-00001.json':\n"
        "        os.killpg(os.getpgrp(), signal.SIGINT)\n"
        "tokenized._write_json = write_then_ctrl_c\n"
        "from torchpar.commands import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    cmd = [sys.executable, "-c", ctrl_c_after_shard_1, "prepare-data", "--config", str(TINY), "--out",
           str(out), "--processes", "2", "--docs-per-shard", "16"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.count("torchpar: error:") == 1, err
    assert "run the same command again to resume" in err.splitlines()[-1]
    assert not (out / MANIFEST).exists() and not list(out.glob("*.tmp"))
    resumed = prepare_cli(tmp_path, out, "--processes", "2", "--docs-per-shard", "16")
    assert "resuming" in resumed
    whole = tmp_path / "whole"
    prepare_cli(tmp_path, whole, "--processes", "2", "--docs-per-shard", "16")
    assert folder_bytes(out) == folder_bytes(whole)


def test_an_interrupted_preparation_leaves_no_half_written_shard(tmp_path):
    """Ctrl-C while a shard is being written: the pool terminates its workers, which cannot clean
    up after themselves, so the run removes what they left half-written (here a worker's temporary
    file appears just before the interrupt); the same command run again writes the same bytes."""
    docs = [f"word{i} " * (i + 1) for i in range(20)]

    class Interrupted(ListSource):
        def __getitem__(self, i: int) -> str:
            if i == 12:
                (tmp_path / "cut" / "shard-00001.bin.tmp").write_bytes(b"half a shard")
                raise KeyboardInterrupt
            return super().__getitem__(i)

    with pytest.raises(KeyboardInterrupt):
        prepare(Interrupted(docs), TOK, tmp_path / "cut", processes=1, docs_per_shard=8, quiet=True)
    assert not list((tmp_path / "cut").glob("*.tmp"))
    prepare(ListSource(docs), TOK, tmp_path / "cut", processes=1, docs_per_shard=8, quiet=True)
    prepare(ListSource(docs), TOK, tmp_path / "whole", processes=1, docs_per_shard=8, quiet=True)
    assert folder_bytes(tmp_path / "cut") == folder_bytes(tmp_path / "whole")


def test_verify_prepared_checks_the_id_range_and_the_checksums(tmp_path):
    """Ids beyond the vocabulary are found from the manifest alone (cheap, every start), or by
    reading the shards (--check) when the manifest does not record them; a flipped byte fails its
    shard's CRC32."""
    src = ListSource([f"word{i} " * (i + 1) for i in range(20)])
    prepare(src, TOK, tmp_path, processes=1, docs_per_shard=8, quiet=True)
    corpus = TokenizedCorpus(str(tmp_path))
    top = corpus.manifest["max_id"]
    assert top == TOK.eos_id  # every document ends with EOS, the largest id
    verify_prepared(corpus, TOK.n_words, checksums=True)
    with pytest.raises(ConfigError, match=f"token ids up to {top}, beyond the model's vocab_size {top}"):
        verify_prepared(corpus, top, checksums=False)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    del manifest["max_id"]  # as a corpus prepared before it was recorded
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    corpus = TokenizedCorpus(str(tmp_path))
    verify_prepared(corpus, top, checksums=False)  # nothing to go on without reading
    with pytest.raises(ConfigError, match=f"shard-00000.bin holds token id {top}, beyond"):
        verify_prepared(corpus, top, checksums=True)
    shard = tmp_path / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="shard-00001.bin fails its CRC32 check"):
        verify_prepared(corpus, TOK.n_words, checksums=True)


def test_a_corpus_of_one_character_repeats_in_every_window(tmp_path, capfd):
    """Documented behaviour: one document of one character (BOS x EOS, 3 tokens) trains, each
    window the document over and over, alike in both readers; prepare-data warns that the
    corpus is smaller than one window."""
    (tmp_path / "x.txt").write_text("x")
    src = FileSource(str(tmp_path / "x.txt"), "text")
    code, err = prepare_in_process(capfd, tmp_path, tmp_path / "p", corpus=tmp_path / "x.txt")
    assert code == 0 and "the corpus holds 3 tokens, fewer than one training window" in err, err
    corpus = TokenizedCorpus(str(tmp_path / "p"))
    doc = TOK.encode("x")
    cycles = [torch.tensor([doc[(s + i) % 3] for i in range(11)]) for s in range(3)]
    text, tokens = (batches(PackedWindows(s, TOK, 10, 2, 0, 1, seed=0, lanes=4), 3) for s in (src, corpus))
    for a, b in zip(text, tokens):
        assert torch.equal(a, b)
        assert all(any(torch.equal(row, c) for c in cycles) for row in a)


def test_jsonl_nulls_are_skipped_and_an_escaped_nul_is_text(tmp_path, capfd):
    """``{"text": null}`` is skipped, counted and warned about (never the text "None"); a NUL
    written as the JSON escape is a character the byte-level tokenizer round-trips; a raw NUL byte
    in a file is refused (see the bad-inputs table)."""
    (tmp_path / "a.jsonl").write_text('{"text": "a\\u0000b"}\n{"text": null}\n{"text": "c"}\n')
    src = FileSource(str(tmp_path / "a.jsonl"), "text")
    assert src.docs == ["a\0b", "c"] and src.skipped == {"null": 1}
    assert "skipped 1 record(s) whose \"text\" is null (the first at" in capfd.readouterr().err
    assert TOK.decode(TOK.encode(src[0], bos=False, eos=False)) == "a\0b"


def test_prepare_data_prepares_one_source_of_a_mixture(tmp_path, capfd):
    """With [[data.sources]], --source NAME prepares that source (and only it)."""
    rows = (json.dumps({"text": f"x = {i}\n"}) + "\n" for i in range(20))
    (tmp_path / "code.jsonl").write_text("".join(rows))
    mix = tmp_path / "mix.toml"
    mix.write_text(f'extends = "{TINY}"\n[[data.sources]]\nweight = 1\n[[data.sources]]\nname = "code"\n'
                   f'weight = 1\ndataset = "files"\npath = "{tmp_path}/code.jsonl"\n')
    from torchpar.commands import main

    assert main(["prepare-data", "--config", str(mix), "--out", str(tmp_path / "p"), "--source", "code"]) == 0
    corpus = TokenizedCorpus(str(tmp_path / "p"))
    assert corpus.fingerprint() == FileSource(str(tmp_path / "code.jsonl"), "text").fingerprint()
