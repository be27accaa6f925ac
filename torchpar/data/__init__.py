"""Data: document sources, packing into windows, sharding over data-parallel ranks."""

from torchpar.data.loader import PackedWindows, build_dataloader, data_identity, resume_notes
from torchpar.data.sources import DocumentSource, FileSource, HFSource, StdlibSource, build_source

__all__ = ["DocumentSource", "FileSource", "HFSource", "PackedWindows", "StdlibSource", "build_dataloader",
           "build_source", "data_identity", "resume_notes"]
