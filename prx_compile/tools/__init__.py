"""The applications built on the library: the ``prx-compile`` command (``cli``), multi-process
generation (``generate.generate_images``), the benchmark harness (``bench``), the diffusers pipeline
loader (``pipeline.load_pipeline``) and the tiny/full-size PRX fixtures (``testing``).

The library (every ``prx_compile`` module outside this package) never imports from here;
``tests/test_layout.py`` checks it. Only ``prx_compile/__main__.py``, the entry point of
``python -m prx_compile``, does.
"""
