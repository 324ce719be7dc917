"""``encode_sparse`` (SBC, STC, top-k): the encoding of ``encode``, and positions and values that
make exactly the reconstruction ``encode_with_reconstruction`` returns. Error feedback takes those
values off its residual, and a client keeps them as what it sent
(:class:`fedcomp.methods.sent.KeptValues`), so both rest on this equality, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs import SBC, STC, Codec, TopK
from fedcomp.methods.sent import KeptValues
from tests.codecs.test_engine import varied_update

CODECS: list[Codec] = [
    SBC(0.05),
    SBC(0.02, "exact"),
    STC(0.05),
    STC(0.02, "fast", sample_size=500),
    TopK(p=0.03),
    TopK(p=0.03, values="float16"),  # (huge_range: values past 65504 saturate, tiny ones go to 0)
]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("name", list(varied_update()))
def test_encode_sparse_is_the_encoding_and_the_reconstruction(codec: Codec, name: str) -> None:
    x = varied_update(3)[name]
    try:
        want_enc, recon = codec.encode_with_reconstruction(x, name)
    except ValueError:  # (a tensor this codec refuses: encode_sparse refuses it the same way)
        with pytest.raises(ValueError):
            codec.encode_sparse(x, name)  # type: ignore[attr-defined]
        return
    found = codec.encode_sparse(x, name)  # type: ignore[attr-defined]
    assert found is not None
    enc, positions, values = found
    assert enc == want_enc
    assert positions.dtype == np.int64 and np.all(np.diff(positions) > 0)
    kept = KeptValues(tuple(x.shape), positions, values)
    assert kept.dense().numpy().tobytes() == recon.numpy().tobytes()
    # what a pending record is written from: the dense tensor's non-zeros, in order
    flat = recon.reshape(-1)
    nz = flat.nonzero().view(-1)
    got_positions, got_values = kept.nonzero()
    assert np.array_equal(got_positions, nz.numpy()) and got_values.tobytes() == flat[nz].numpy().tobytes()


def test_off_the_cpu_there_is_no_sparse_encoding() -> None:
    meta = torch.zeros(100, device="meta")
    assert all(codec.encode_sparse(meta, "w") is None for codec in CODECS)  # type: ignore[attr-defined]


def test_values_that_decode_to_zero_are_no_non_zeros() -> None:
    """Top-k in float16 of values below its smallest subnormal: positions sent, zeros decoded."""
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(5000).astype(np.float32)) * 1e-9
    x[7] = 1.0  # one value that survives
    codec = TopK(p=0.01, values="float16")
    enc, recon = codec.encode_with_reconstruction(x, "w")
    found = codec.encode_sparse(x, "w")
    assert found is not None and found[0] == enc
    kept = KeptValues((5000,), found[1], found[2])
    assert kept.positions.shape[0] == 50 and int((kept.values == 0).sum()) == 49
    positions, values = kept.nonzero()
    assert positions.tolist() == [7] and values.tolist() == [1.0]
    assert torch.equal(kept.dense(), recon) and kept.sum_of_squares() == 1.0
