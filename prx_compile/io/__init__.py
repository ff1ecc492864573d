"""Files: ``artifact`` (the on-disk format: a directory whose ``manifest.json`` lists every file with its
size and sha256), ``saving`` (``save_compiled`` / ``load_compiled``: a CompiledTransformer to and from an
artifact) and ``cache`` (the engine cache: built engine sets reused across processes).

The modules are imported by their paths (``prx_compile.io.saving``); ``import io`` anywhere still means
the standard library's.
"""
