"""``torchpar prepare-data``: tokenize the config's corpus once into shards that
data.dataset = 'tokenized' reads."""

from __future__ import annotations

import os

from torchpar.config import load_config
from torchpar.console import ArgumentParser, at_least, error, warn
from torchpar.data.sources import build_source, source_specs
from torchpar.data.tokenized import TokenizedCorpus, _shard_done, is_own_folder, n_shards, prepare
from torchpar.errors import ConfigError
from torchpar.outputs import add_overwrite, claim
from torchpar.tokenizer import TokenizerError, load_tokenizer


def _data_to_prepare(data, name: str | None):
    """The [data] section to prepare: the section itself, or with [[data.sources]] the one that
    --source names (a mixture is prepared one corpus at a time)."""

    specs = source_specs(data)
    names = [n for n, _, _ in specs]
    if not data.sources:
        if name is not None:
            raise ConfigError("--source NAME picks one of [[data.sources]], and this config has none; "
                              "leave --source out")
        return data
    if name is None:
        raise ConfigError(f"data.sources lists {len(names)} sources ({', '.join(names)}); prepare-data "
                          "writes one corpus: run it once per source with --source NAME --out DIR, then set "
                          "that source's dataset = 'tokenized' and path = DIR")
    if name not in names:
        raise ConfigError(f"--source {name!r} is not one of data.sources' names ({', '.join(names)})")
    return specs[names.index(name)][1]


def prepare_main(argv: list[str]) -> int:
    """``torchpar prepare-data``: the corpus that [data] names, tokenized once with the run's tokenizer."""

    p = ArgumentParser(prog="torchpar prepare-data", description=(
        "Tokenize the corpus that the config's [data] section names (dataset, path, split, text_field; "
        "training.seed orders the stdlib corpus) with model.tokenizer_path, into shards that "
        "data.dataset = 'tokenized' with data.path = OUT reads. Resumes an interrupted run: run the "
        "same command again. OUT must be new, empty or an earlier preparation's folder."))
    p.add_argument("--config", help="TOML job config (default: built-in defaults)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--source", help="with [[data.sources]]: the name of the one source to prepare")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--docs-per-shard", type=int, default=0,
                   help="documents per shard file; 0 = from the corpus size (about 64 shards, 16 to 65536 "
                        "documents each): the bytes depend on it and the corpus, never on --processes")
    add_overwrite(p)
    args, overrides = p.parse_known_args(argv)
    at_least("--processes", args.processes, 1)
    at_least("--docs-per-shard", args.docs_per_shard, 0)
    cfg = load_config(args.config, overrides)
    data = _data_to_prepare(cfg.data, args.source)
    if data.dataset == "tokenized":
        raise ConfigError("data.dataset = 'tokenized' is already prepared; name the raw corpus to prepare")
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    except TokenizerError as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
    folder = claim("--out", args.out, folder=True, overwrite=args.overwrite, own=is_own_folder)
    source = build_source(data, cfg.training.seed)
    if isinstance(source, TokenizedCorpus):
        raise ConfigError(f"data.path {data.path!r} is already a prepared corpus; train on it with "
                          "data.dataset = 'tokenized'")
    per = args.docs_per_shard or min(max(-(-len(source) // 64), 16), 65536)
    try:
        m = prepare(source, tokenizer, folder, args.processes, per)
    except KeyboardInterrupt:
        done = sum(_shard_done(folder, i) is not None for i in range(n_shards(len(source), per)))
        error(f"prepare-data interrupted with {done} of {n_shards(len(source), per)} shards written to "
              f"{folder}; run the same command again to resume")
        return 130
    window = cfg.training.seq_len + 1
    if m["n_tokens"] < window:  # trains, but every window repeats the same few tokens
        warn(f"the corpus holds {m['n_tokens']} tokens, fewer than one training window (training.seq_len + "
             f"1 = {window}); every window repeats it")
    print(f"prepare-data: {m['n_documents']:,} documents, {m['n_tokens']:,} tokens ({m['dtype']}) in "
          f"{len(m['shards'])} shards -> {folder}; skipped {m['skipped'] or 'none'}")
    return 0
