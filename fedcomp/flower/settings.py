"""The compression settings of a Flower run (:class:`CompressionConfig`), as the apps import them.

The model itself lives with the methods it configures (:mod:`fedcomp.methods.config`).
"""

from fedcomp.methods.config import CompressionConfig, format_validation_error

__all__ = ["CompressionConfig", "format_validation_error"]
