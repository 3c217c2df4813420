"""sglang-eagle-overlap: grammar-constrained requests stay in SGLang's overlapped EAGLE pipeline.

Importing this package does nothing. SGLang calls :func:`sglang_eagle_overlap.plugin.load` through the entry point
group ``sglang.srt.plugins`` in every process that runs ``load_plugins()``.
"""

__version__ = "0.1.0"
SUPPORTED_SGLANG_VERSIONS = ("0.5.16", "0.5.23")

__all__ = ["SUPPORTED_SGLANG_VERSIONS", "__version__"]
