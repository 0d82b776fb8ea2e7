"""CupyBackend.override_kernels, the one public way tools swap kernels (no GPU: an unbound call
on a stand-in that has only the override table)."""

import types

import pytest

pytest.importorskip("torch")
from lserve.attention.cupy_backend import CupyBackend  # noqa: E402


class _Module:
    def get_function(self, name):
        return f"edited:{name}"


def _stub():
    return types.SimpleNamespace(_kernel_overrides={})


def test_override_serves_the_family_then_clears():
    be = _stub()
    CupyBackend.override_kernels(be, "decode_tc", _Module())
    assert CupyBackend._kernel(be, "decode_tc", "ls_decode_tc") == "edited:ls_decode_tc"
    CupyBackend.clear_kernel_overrides(be)
    assert be._kernel_overrides == {}


def test_override_rejects_unknown_family_and_entry_point():
    be = _stub()
    with pytest.raises(ValueError, match="unknown kernel family"):
        CupyBackend.override_kernels(be, "nope", _Module())
    with pytest.raises(ValueError, match="has no kernel"):
        CupyBackend.override_kernels(be, "decode_tc", _Module(), names=("ls_nope",))
