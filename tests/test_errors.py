"""Parameter checks name the key and say whether the type or the range was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcomp.codecs import SBC, STC, ThreeLC, TopK
from fedcomp.errors import ConfigError, check_number


def test_a_string_is_named_as_the_wrong_type_not_the_wrong_range() -> None:
    with pytest.raises(ConfigError, match=r"^p: must be a number in \(0, 0\.5\], got str '0\.1'$"):
        SBC(p="0.1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^s: must be a number in \[1, 2\), got str '1'$"):
        ThreeLC(s="1")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 0.51, math.nan, math.inf])
def test_out_of_range_values_are_named_with_their_interval(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"^p: must be in \(0, 0\.5\], got "):
        SBC(p=bad)


def test_numpy_scalars_are_numbers() -> None:
    assert SBC(p=np.float32(0.25)).p == pytest.approx(0.25)
    assert TopK(p=np.float64(0.5)).p == 0.5
    assert ThreeLC(s=np.int64(1)).s == 1.0
    assert STC(p=np.float32(0.5)).p == 0.5


def test_a_bool_is_not_a_number() -> None:
    with pytest.raises(ConfigError, match="got bool True"):
        check_number("x", True, low=0.0, high=1.0)


@pytest.mark.parametrize(
    ("low_open", "high_open", "value", "ok"),
    [
        (True, False, 0.0, False),
        (True, False, 1.0, True),
        (False, True, 0.0, True),
        (False, True, 1.0, False),
    ],
)
def test_the_interval_ends(low_open: bool, high_open: bool, value: float, ok: bool) -> None:
    if ok:
        assert check_number("x", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open) == value
    else:
        with pytest.raises(ConfigError, match="^x: must be in "):
            check_number("x", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open)


# --- library entry points: wrong arguments get typed errors that say what is needed -------------


def test_a_numpy_array_is_named_as_not_a_tensor() -> None:
    from fedcomp.methods.update import UpdateEncoder

    with pytest.raises(TypeError, match=r"^tensor 'w': a torch.Tensor is needed, got numpy.ndarray \(torch.from_numpy"):
        SBC().encode(np.zeros(3, np.float32), "w")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^tensor 'w': a torch.Tensor is needed"):  # (not AttributeError)
        UpdateEncoder(SBC()).encode_to_bytes({"w": np.zeros(3, np.float32)})  # type: ignore[dict-item]


def test_a_rank_the_wire_cannot_carry_is_refused_when_encoding() -> None:
    """Rank 9 encoded fine and every receiver refused it; the sender hears it now."""
    import torch

    from fedcomp.codecs import DenseFP32

    for codec in (SBC(p=0.1), DenseFP32()):
        with pytest.raises(ValueError, match=r"^tensor 'w': rank 9 exceeds 8"):
            codec.encode(torch.zeros([2] * 9), "w")
    assert DenseFP32().encode(torch.zeros([2] * 8), "w").shape == (2,) * 8


def test_a_spec_of_a_dtype_the_wire_does_not_carry_says_so() -> None:
    import torch

    from fedcomp.codecs import TensorSpec
    from fedcomp.errors import PayloadError

    enc = SBC(p=0.1).encode(torch.randn(72), "w")
    with pytest.raises(PayloadError, match="spec says dtype torch.int64, which the wire format does not carry"):
        SBC(p=0.1).decode(enc, TensorSpec("w", (72,), torch.int64))


def test_codecs_where_codecs_are_needed() -> None:
    from fedcomp.codecs import get_codec
    from fedcomp.methods.feedback import ErrorFeedback
    from fedcomp.methods.update import UpdateEncoder

    with pytest.raises(TypeError, match=r"^codec: a Codec is needed .* got 'sbc'"):
        UpdateEncoder("sbc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^small_codec: a Codec is needed"):
        UpdateEncoder(SBC(), small_codec="dense-fp32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^min_numel: must be an integer >= 0, got '10'"):
        UpdateEncoder(SBC(), min_numel="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^codec: a Codec is needed"):
        ErrorFeedback("sbc")  # type: ignore[arg-type]
    for bad in (None, ["sbc"], 3):
        with pytest.raises(ConfigError, match=r"^codec config: a codec id or a mapping"):
            get_codec(bad)  # type: ignore[arg-type]


def test_a_long_tensor_name_is_shortened_in_the_message_only() -> None:
    from fedcomp.errors import PayloadError

    err = PayloadError("n" * 70_000, "bad")
    assert err.tensor == "n" * 70_000 and len(str(err)) < 250 and str(err).endswith("...': bad")


@pytest.mark.parametrize("codec", [SBC(), ThreeLC(), TopK(p=0.5), STC()], ids=lambda c: c.codec_id)
def test_a_float64_past_float32s_range_is_named_as_such_not_as_non_finite(codec) -> None:
    """Every codec computes in float32: 1e300 became an infinity there, and the codec said the
    input was not finite. A real infinity still gets the codec's own message."""
    import torch

    with pytest.raises(ValueError, match=r"^tensor 'w': values beyond float32's range \(max \|T\| = 1e\+300\)"):
        codec.encode(torch.tensor([1e300, 1.0], dtype=torch.float64), "w")
    with pytest.raises(ValueError, match="non-finite|NaN or infinite") as err:
        codec.encode(torch.tensor([math.inf, 1.0], dtype=torch.float64), "w")
    assert "float32's range" not in str(err.value)


def test_decoding_needs_a_list_of_codecs() -> None:
    import torch

    from fedcomp.codecs import DenseFP32
    from fedcomp.methods.update import UpdateEncoder, decode_update_bytes, specs_of

    model = {"w": torch.randn(10)}
    data = UpdateEncoder(SBC()).encode_to_bytes(model)
    with pytest.raises(TypeError, match=r"^codecs: a list of the codecs accepted is needed"):
        decode_update_bytes(data, specs_of(model), SBC())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^codecs: 'dense-fp32' is not a Codec"):
        decode_update_bytes(data, specs_of(model), [SBC(), "dense-fp32"])  # type: ignore[list-item]
    assert torch.equal(decode_update_bytes(data, specs_of(model), [SBC(), DenseFP32()])[1]["w"], model["w"])
