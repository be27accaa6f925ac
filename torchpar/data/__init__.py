"""Data: document sources, prepared corpora, packing into windows, sharding over data-parallel ranks."""

from torchpar.data.loader import PackedWindows, build_dataloader, data_identity, document_ids, resume_notes
from torchpar.data.sources import (
                                   ChatSource,
                                   DocumentSource,
                                   FileSource,
                                   HFSource,
                                   StdlibSource,
                                   build_source,
                                   chat_data,
                                   loss_masked,
                                   source_specs,
)
from torchpar.data.tokenized import TokenizedCorpus

__all__ = ["ChatSource", "DocumentSource", "FileSource", "HFSource", "PackedWindows", "StdlibSource",
           "TokenizedCorpus", "build_dataloader", "build_source", "chat_data", "data_identity",
           "document_ids", "loss_masked", "resume_notes", "source_specs"]
