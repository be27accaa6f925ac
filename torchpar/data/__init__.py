"""Data: document sources, prepared corpora, packing into windows, sharding over data-parallel ranks."""

from torchpar.data.loader import PackedWindows, build_dataloader, data_identity, document_ids, resume_notes
from torchpar.data.sources import (
                                   DocumentSource,
                                   FileSource,
                                   HFSource,
                                   StdlibSource,
                                   build_source,
                                   source_specs,
)
from torchpar.data.tokenized import TokenizedCorpus

__all__ = ["DocumentSource", "FileSource", "HFSource", "PackedWindows", "StdlibSource", "TokenizedCorpus",
           "build_dataloader", "build_source", "data_identity", "document_ids", "resume_notes",
           "source_specs"]
