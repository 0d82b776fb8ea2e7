"""CupyBackend.override_kernels and tune, the public ways tools swap kernels and launch shapes (no GPU: unbound calls
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


def test_tuning_is_validated_once_and_replaced_whole():
    from dataclasses import replace

    from lserve.attention.cupy_tuning import CupyTuning

    t = CupyTuning()
    assert (t.target_ctas, t.min_chunk, t.score_ppb) == (None, 2, None)
    assert replace(t, target_ctas=1, min_chunk=256).min_chunk == 256
    for bad in ({"min_chunk": 0}, {"min_chunk": None}, {"target_ctas": 0}, {"score_ppb": -4}, {"score_ppb": 2.5}):
        with pytest.raises(ValueError):
            replace(t, **bad)
    be = types.SimpleNamespace(tuning=t)
    assert CupyBackend.tune(be, score_ppb=16).score_ppb == 16 and be.tuning.min_chunk == 2
