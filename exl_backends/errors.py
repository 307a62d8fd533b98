"""The project's error types: each names what is at fault and says what to do."""


class ExlError(Exception):
    """Base class of every error exl-backends raises on purpose."""


class ConfigError(ExlError):
    """config.json is missing, unreadable, or lacks a field the model needs."""


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture has no row in the traits table."""


class CheckpointError(ExlError):
    """A weight file is missing, corrupt, or disagrees with the config (names tensor and file)."""


class UnsupportedFormatError(CheckpointError):
    """The directory holds a format we do not load (AWQ, GGUF, FP8, ...)."""


class ContextLengthError(ExlError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


class DeviceError(ExlError):
    """The GPU path cannot run here: no GPU, no CuPy, or a GPU too old."""


class OutOfMemoryPlanError(ExlError):
    """The memory plan does not fit the device; the message carries the numbers."""


class SamplingError(ExlError, ValueError):
    """A sampling parameter or constraint is invalid, or a combination of them is unsupported (names the field)."""
