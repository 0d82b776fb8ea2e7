"""Attention backends behind one plan/run interface."""

from lserve.attention.base import AttentionBackend


def make_backend(name: str, *args, **kwargs) -> AttentionBackend:
    """Instantiate backend ``name`` ("torch" or "cupy")."""
    if name == "torch":
        from lserve.attention.torch_backend import TorchBackend

        return TorchBackend(*args, **kwargs)
    if name == "cupy":
        from lserve.attention.cupy_backend import CupyBackend

        return CupyBackend(*args, **kwargs)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "make_backend"]
