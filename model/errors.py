"""Typed errors of the model layer: what is wrong with a checkpoint."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: a missing file, tensor or a wrong shape."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one this engine implements."""
