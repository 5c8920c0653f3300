"""gradtape.formats: validating readers for the files models and adapters come in.

``gguf_reader`` (GGUF: header, metadata, tensor table) and ``safetensors_reader`` check
every count, offset, dtype and shape against the file before anything is allocated or
viewed, and raise ``FileFormatError``; nothing here unpickles.  They know bytes, not
models: which tensors a model needs is ``gradtape.models``' business.  Imports only
``errors``.
"""
