"""Chat data for supervised fine-tuning (data.format = 'chat'): the Llama 3 template token by token
with its loss mask, packing that never splits a conversation, the one-line refusals of malformed
records, the mask carried through the windows into inputs, targets and documents, prepared chat
corpora equal to on-the-fly ones, and (spawned) layouts equal to one process with the loss a mean
over the assistant's tokens of the whole step."""

import json
import re
import types

import pytest
import torch
from harness import ROOT, TINY, run_layouts

from torchpar.config import load_config
from torchpar.data import ChatSource, PackedWindows, TokenizedCorpus, build_source, document_ids
from torchpar.data.chat import TEMPLATES, pack
from torchpar.data.tokenized import prepare
from torchpar.errors import ConfigError
from torchpar.loss import IGNORE, NO_LOSS, target_count, tokens_ahead
from torchpar.parallel.context import inputs_and_targets
from torchpar.preflight import preflight
from torchpar.tokenizer import BUILTIN, Tokenizer

CHAT = ROOT / "torchpar" / "assets" / "chat"
ONE_RANK = types.SimpleNamespace(cp=1)  # (a layout without context parallelism)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": " 5 "}, {"role": "user", "content": "Thanks"},
                {"role": "assistant", "content": "You are welcome."}]


def chat(*overrides) -> list[str]:
    return ["--data.dataset", "files", "--data.format", "chat", "--data.path", str(CHAT / "train.jsonl"),
            "--validation.path", str(CHAT / "validation.jsonl"), "--model.vocab_size", "4104",
            "--data.document_masking", "true", "--training.seq_len", "128", *overrides]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN)


def test_the_llama3_template_masks_all_but_the_assistants_turns(tok):
    """BOS, then each message's header, content and <|eot_id|>, as Llama 3 renders them; the only
    targets are the assistant's content (stripped) and its <|eot_id|>, token by token."""
    ids = TEMPLATES["llama3"].render(CONVERSATION, tok)
    plain = [t % NO_LOSS for t in ids]
    assert tok.decode(plain) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYou are welcome.<|eot_id|>")
    eot = tok.special("<|eot_id|>")
    expected = [*tok.encode("5", bos=False, eos=False), eot,
                *tok.encode("You are welcome.", bos=False, eos=False), eot]
    assert [t for t in ids if t < NO_LOSS] == expected
    # every target is a contiguous run right after an assistant header
    header = [*tok.encode("assistant", bos=False, eos=False), tok.special("<|end_header_id|>"),
              *tok.encode("\n\n", bos=False, eos=False)]
    runs, i = [], 0
    while i < len(ids):
        if ids[i] < NO_LOSS:
            j = i
            while j < len(ids) and ids[j] < NO_LOSS:
                j += 1
            assert plain[i - len(header):i] == header
            runs.append(ids[i:j])
            i = j
        i += 1
    assert len(runs) == 2 and all(r[-1] == eot for r in runs)
    assert TEMPLATES["llama3"].vocab_size(tok) == tok.n_words + 8


# Each template as its model's tokenizer_config.json writes it (Llama 3 8B Instruct's; Qwen's ChatML,
# which Qwen3 renders the same for turns without reasoning).
JINJA = {
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
              "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
              "{% endif %}{{ content }}{% endfor %}",
    "qwen3": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
             "'<|im_end|>' + '\n'}}{% endfor %}",
}
HF_TOKENIZERS = {  # (special tokens, tokenizer_config.json's BOS and EOS)
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
}


@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory):
    """A small byte-level BPE tokenizer.json with each template's special tokens, trained here, and
    its tokenizer_config.json (BOS, EOS, the chat template)."""
    from tokenizers import Tokenizer as BPE
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = {}
    for name, (specials, bos, eos) in HF_TOKENIZERS.items():
        folder = tmp_path_factory.mktemp(name)
        tok = BPE(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        texts = [m["content"] for m in CONVERSATION] * 20
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": bos, "eos_token": eos, "chat_template": JINJA[name]}))
        out[name] = folder
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_each_template_renders_what_its_models_chat_template_renders(hf_tokenizers, name):
    """With a tokenizers JSON file and its config, the ids equal transformers' apply_chat_template of
    the model's own Jinja template (Qwen's after the <|endoftext|> that starts each document here,
    as Qwen names no BOS); the targets are the assistant's content and end token."""
    transformers = pytest.importorskip("transformers")
    from torchpar.tokenizer import HFTokenizer, load_tokenizer

    ours = load_tokenizer(str(hf_tokenizers[name]))
    assert isinstance(ours, HFTokenizer)
    ids = TEMPLATES[name].render(CONVERSATION, ours)
    config = json.loads((hf_tokenizers[name] / "tokenizer_config.json").read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_tokenizers[name] / "tokenizer.json"),
                                              **config)
    theirs = list(hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    plain = [t % NO_LOSS for t in ids]
    assert (plain if name == "llama3" else plain[1:]) == theirs
    end = ours.special("<|eot_id|>" if name == "llama3" else "<|im_end|>")
    targets = [t for t in ids if t < NO_LOSS]
    assert targets == [*ours.encode("5" if name == "llama3" else " 5 ", bos=False, eos=False), end,
                       *ours.encode("You are welcome.", bos=False, eos=False), end]


def test_a_tokenizers_file_reads_like_the_rank_file(hf_tokenizers, tmp_path, tok):
    """A folder with tokenizer.json alone loads it; special-token text inside a document stays
    text; a tokenizer whose BOS and EOS are one token (Qwen's <|endoftext|>) separates documents
    with it once; a template whose markers the tokenizer lacks is one line, either way round."""
    from torchpar.tokenizer import load_tokenizer

    qwen = load_tokenizer(str(hf_tokenizers["qwen3"]))
    eot = qwen.special("<|endoftext|>")
    assert qwen.bos_id == qwen.eos_id == eot
    ids = qwen.encode("a <|im_end|> b")
    assert ids[0] == eot and eot not in ids[1:] and qwen.special("<|im_end|>") not in ids
    assert qwen.decode(ids[1:]) == "a <|im_end|> b"
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    for template, tokenizer, missing in (("qwen3", tok, "<|im_start|>"),
                                         ("llama3", qwen, "<|start_header_id|>")):
        message = f"data.chat_template = '{template}': the tokenizer has no special token "
        message += re.escape(missing)
        with pytest.raises(ConfigError, match=message):
            ChatSource(str(path), "messages", TEMPLATES[template], tokenizer, 64, "truncate")


def test_packing_never_splits_a_conversation():
    """Conversations fill windows in order; one that does not fit starts the next, the rest is
    padding; one longer than a window is cut to it or left out, counted."""
    pad = 9 | NO_LOSS
    convs = [[1] * 4, [2] * 5, [3] * 2, [4] * 12, [5] * 10]
    bins, counts = pack(convs, 10, "truncate", pad)
    assert bins.tolist() == [[1] * 4 + [2] * 5 + [pad], [3] * 2 + [pad] * 8, [4] * 10, [5] * 10]
    assert counts == {"truncated": 1, "dropped": 0}
    bins, counts = pack(convs, 10, "drop", pad)
    assert bins.tolist() == [[1] * 4 + [2] * 5 + [pad], [3] * 2 + [pad] * 8, [5] * 10]
    assert counts == {"truncated": 0, "dropped": 1}


@pytest.mark.parametrize("line, message", [
    ('{"text": "hi"}', r"records\.jsonl:2: no field 'messages' \(has \['text'\]\); set data\.messages_field"),
    ('{"messages": []}', r"records\.jsonl:2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"records\.jsonl:2: message 0 is not \{\"role\": \"\.\.\.\", "
                                          r"\"content\": \"\.\.\.\"\} with strings"),
    ('{"messages": [{"role": "bot", "content": "x"}]}',
     r"records\.jsonl:2: message 0's role 'bot' is not one the llama3 template renders \(system, user"),
    ('{"messages": ', r"records\.jsonl:2: not a JSON object"),
])
def test_a_malformed_conversation_is_one_line(tmp_path, tok, line, message):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message):
        ChatSource(str(path), "messages", TEMPLATES["llama3"], tok, 64, "truncate")


def test_conversations_without_an_answer_are_counted_and_the_rest_described(tmp_path, tok):
    path = tmp_path / "records.jsonl"
    question = {"messages": [{"role": "user", "content": "Anyone?"}]}
    path.write_text("\n".join(json.dumps(r) for r in [question, {"messages": CONVERSATION}, question]))
    source = ChatSource(str(path), "messages", TEMPLATES["llama3"], tok, 128, "truncate")
    assert source.skipped == {"no assistant turn": 2} and len(source) == 1
    assert source.describe().startswith("1 conversations (llama3 template) in 1 windows, 2 left out")
    path.write_text(json.dumps(question))
    with pytest.raises(ConfigError, match="no conversation with an assistant turn"):
        ChatSource(str(path), "messages", TEMPLATES["llama3"], tok, 128, "truncate")


def test_the_mask_reaches_inputs_targets_and_documents(tok):
    """Windows with NO_LOSS bits: the model reads plain ids, the loss ignores the prompt's
    targets, documents start at every BOS (flagged or not), multi-token prediction reads ids and
    keeps the bit for its loss; target_count counts what the loss counts."""
    bos = tok.bos_id
    rows = torch.tensor([[bos | NO_LOSS, 7 | NO_LOSS, 8, 9, bos | NO_LOSS, 10, 11 | NO_LOSS]])
    inputs, targets = inputs_and_targets(rows, ONE_RANK)
    assert inputs.tolist() == [[bos, 7, 8, 9, bos, 10]]
    assert targets.tolist() == [[IGNORE, 8, 9, IGNORE, 10, IGNORE]]
    assert document_ids(rows[:, :-1], bos).tolist() == [[1, 1, 1, 1, 2, 2]]
    assert target_count(rows) == 3 == int((targets != IGNORE).sum())
    ahead = tokens_ahead(rows, 1)
    assert ahead[0, :, 1].tolist() == [8, 9, bos | NO_LOSS, 10, 11 | NO_LOSS, IGNORE]


def test_a_prepared_chat_corpus_reads_the_windows_of_the_files(tmp_path, tok):
    """prepare-data writes the packed windows with their masks (uint32, bit 31): every data-parallel
    rank's batches equal the on-the-fly reader's; another sequence length or format is refused."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((CHAT / "validation.jsonl").read_text().splitlines(keepends=True)[:60]))
    cfg = load_config(TINY, chat("--data.path", str(path))).data
    source = build_source(cfg, 0, tok, 129)
    manifest = prepare(source, tok, tmp_path / "prepared", 1, 8, quiet=True)
    assert manifest["dtype"] == "uint32" and manifest["window"] == 129 and manifest["max_id"] < 4104
    prepared = load_config(TINY, chat("--data.path", str(tmp_path / "prepared"))).data
    corpus = build_source(prepared, 0, tok, 129)
    assert isinstance(corpus, TokenizedCorpus) and corpus.name == source.name
    assert corpus.fingerprint() == source.fingerprint()
    for rank in range(2):
        a, b = (iter(PackedWindows(s, tok, 128, 2, rank, 2, 0, lanes=4)) for s in (source, corpus))
        for _ in range(5):
            x, y = next(a), next(b)
            assert torch.equal(x, y) and (x >= NO_LOSS).any() and (x < NO_LOSS).any()
    with pytest.raises(ConfigError, match=r"packed into windows of 129 tokens \(training.seq_len = 128\)"):
        build_source(prepared, 0, tok, 65)
    with pytest.raises(ConfigError, match="was prepared with data.format = chat; set data.format to that"):
        build_source(load_config(TINY, ["--data.dataset", "tokenized", "--data.path",
                                         str(tmp_path / "prepared")]).data, 0, tok, 129)


def test_the_sft_config_reads_the_shipped_conversations(monkeypatch):
    """train_configs/sft_debug.toml passes every check before launch, its training and held-out
    sets rendered into windows of its 257 tokens."""
    monkeypatch.chdir(ROOT)
    pre = preflight(load_config(ROOT / "train_configs" / "sft_debug.toml", []), 1)
    assert all(isinstance(s, ChatSource) and s.window == 257 for s in (*pre.sources, pre.val_source))


def test_a_vocabulary_without_the_templates_markers_is_one_line():
    """The debug model's 4,096 tokens end at EOS; the llama3 template's markers reach 4,103."""
    with pytest.raises(ConfigError, match=r"uses token ids up to 4103 .* has vocab_size 4096; set "
                                          r"model.vocab_size = 4104 or more"):
        preflight(load_config(TINY, [*chat(), "--model.vocab_size", "0"]), 1)


# ---------------------------------------------------------------------------- spawned


@pytest.mark.slow
def test_the_loss_is_the_mean_over_the_assistants_tokens():
    """Step 1's logged loss equals the cross-entropy of the initial weights on that step's windows,
    summed over the targets the mask leaves and divided by their number (a third of the positions
    here); held-out losses fall as the model learns the answers. (Layouts against one process:
    tests/test_layouts.py, the rows ending in _chat.)"""
    from torchpar.loss import cross_entropy_sum
    from torchpar.parallel import _local_part

    job = chat("--parallelism.zero_stage", "0", "--validation.enable", "true", "--validation.freq", "2",
               "--validation.steps", "2", "--training.steps", "4")
    run = run_layouts(1, {"one": job})["one"]
    pre = preflight(load_config(TINY, job), 1)
    with torch.device("meta"):
        model = pre.model.build(pre.args)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(0, local_part=_local_part)
    rows = next(iter(PackedWindows(pre.sources[0], pre.tokenizer, 128, 8, 0, 1, 0)))
    inputs, targets = inputs_and_targets(rows, ONE_RANK)
    with torch.no_grad():
        logits = model(inputs, documents=document_ids(rows[:, :-1], pre.tokenizer.bos_id))
    count = target_count(rows)
    assert run["losses"][0] == pytest.approx(cross_entropy_sum(logits, targets).item() / count, rel=1e-5)
    assert count < rows[:, 1:].numel() / 2
    (_, first), *_, (_, last) = run["val_losses"]
    assert last < first
