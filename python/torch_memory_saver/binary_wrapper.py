"""``BinaryWrapper``: the loaded hook (``cdll``) with its C API typed, and ``set_config``."""

from tms.saver import HookHandle


class BinaryWrapper(HookHandle):
    """Constructed from a path as upstream's; ``of`` wraps the handle a Saver already holds."""

    def __init__(self, path_binary: str):
        super().__init__(str(path_binary))

    @classmethod
    def of(cls, handle):
        wrapper = cls.__new__(cls)
        wrapper.__dict__.update(handle.__dict__)
        return wrapper
