import math

import numpy as np
import pytest
import torch

from fedcomp.codecs import TensorSpec
from fedcomp.codecs.gradiveq import GradiVeQ, coefficients_of
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.methods.gradiveq import (
    Basis,
    Compressor,
    aggregate,
    compress,
    decompress,
    fit_compressor,
    num_slices,
    refresh_compressor,
)
from fedcomp.wire import serde
from fedcomp.wire.payloads import GradiVeQBasis, GradiVeQCompressor

D = 16


def low_rank_updates(n_updates, slices, stds, seed=0, noise=1e-4, d=D):
    """Updates whose d-slices are mu + A z, A orthonormal (d x r), z_j ~ N(0, stds_j^2)."""
    g = torch.Generator().manual_seed(seed)
    a, _ = torch.linalg.qr(torch.randn(d, len(stds), generator=g, dtype=torch.float64))
    mu = torch.randn(d, generator=g, dtype=torch.float64) * 0.1
    out = []
    for _ in range(n_updates):
        z = torch.randn(slices, len(stds), generator=g, dtype=torch.float64) * torch.tensor(stds, dtype=torch.float64)
        x = mu + z @ a.t() + noise * torch.randn(slices, d, generator=g, dtype=torch.float64)
        out.append(x.reshape(-1).to(torch.float32))
    return out


def eigen_loss(updates, d, k):
    """Reference eq.-6 loss: tail eigenvalue fraction of the full slices' covariance (NumPy)."""
    x = np.concatenate([u.numpy().astype(np.float64)[: (u.numel() // d) * d].reshape(-1, d) for u in updates])
    x = x - x.mean(0)
    ev = np.sort(np.linalg.eigvalsh(x.T @ x / len(x)))[::-1].clip(min=0)
    return ev[k:].sum() / ev.sum()


# --- fitting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps, k", [(0.05, 2), (0.01, 3), (0.001, 4), (0.5, 1)])
def test_fit_picks_the_smallest_k_meeting_eps(eps, k):
    # variances 100, 25, 4, 1 (+ noise): tail fractions 0.23, 0.038, 0.0077, ~1e-8
    ups = low_rank_updates(30, 64, [10.0, 5.0, 2.0, 1.0])
    comp = fit_compressor({"w": ups}, version=1, slice_size=D, eps=eps)
    b = comp.basis("w")
    assert (b.slice_size, b.dim) == (D, k)
    assert eigen_loss(ups, D, k) <= eps < eigen_loss(ups, D, k - 1) if k > 1 else eigen_loss(ups, D, k) <= eps
    assert b.fit_loss == pytest.approx(eigen_loss(ups, D, k), rel=1e-6, abs=1e-12)
    # U: orthonormal, and the fitted loss is what compressing the samples actually loses
    torch.testing.assert_close(b.basis.t() @ b.basis, torch.eye(k), atol=1e-5, rtol=0)
    x = torch.stack(ups)
    recon = torch.stack([decompress(comp, "w", compress(comp, "w", u), u.numel()) for u in ups])
    mu = b.whitening.repeat(64)
    measured = float(((recon - x) ** 2).sum() / ((x - mu) ** 2).sum())
    assert measured == pytest.approx(b.fit_loss, rel=1e-3, abs=1e-7)
    # eq. 7 (relative to ||x||^2) is bounded by the eq.-6 loss
    assert float(((recon - x) ** 2).sum() / (x**2).sum()) <= eps


def test_exact_low_rank_gives_its_rank():
    ups = low_rank_updates(10, 100, [3.0, 2.0, 1.0], noise=0.0)
    comp = fit_compressor({"w": ups}, version=1, slice_size=D, eps=1e-6)
    assert comp.basis("w").dim == 3
    for u in ups:  # in the span: reconstructed up to float32 rounding
        torch.testing.assert_close(decompress(comp, "w", compress(comp, "w", u), u.numel()), u, atol=1e-5, rtol=0)


def test_fit_is_deterministic_and_bounds_its_samples():
    ups = low_rank_updates(12, 200, [4.0, 1.0, 0.5])
    a = fit_compressor({"w": ups}, 1, D, 0.01, max_samples=500, seed=3)
    b = fit_compressor({"w": ups}, 1, D, 0.01, max_samples=500, seed=3)
    assert a.basis("w").samples == 500
    assert torch.equal(a.basis("w").basis, b.basis("w").basis) and a.digest == b.digest
    assert fit_compressor({"w": ups}, 1, D, 0.01).basis("w").samples == 12 * 200


def test_ragged_last_slice_is_padded_and_not_a_sample():
    ups = [u[:-5] for u in low_rank_updates(10, 100, [3.0, 1.0], noise=0.0)]  # 1595 = 99 full + 11
    comp = fit_compressor({"w": ups}, 1, D, 1e-6)
    assert comp.basis("w").samples == 10 * 99 and comp.basis("w").dim == 2
    c = compress(comp, "w", ups[0])
    assert c.shape == (num_slices(1595, D), 2) == (100, 2)
    assert decompress(comp, "w", c, 1595).shape == (1595,)


def test_which_tensors_are_compressed():
    ups = low_rank_updates(5, 100, [3.0, 1.0])
    noise = [torch.randn(1600, generator=torch.Generator().manual_seed(i)) for i in range(5)]  # full rank
    comp = fit_compressor({"w": ups, "small": [u[:900] for u in ups], "noise": noise, "none": []}, 1, D, 0.01)
    assert comp.compresses("w") and not comp.compresses("small") and not comp.compresses("none")
    assert not comp.compresses("noise")  # full rank: eps 0.01 needs k = d > max_dim (default d - 1)
    assert fit_compressor({"noise": noise}, 1, D, 0.3, max_dim=15).compresses("noise")
    assert not fit_compressor({"w": ups}, 1, D, 0.01, max_dim=1).compresses("w")  # k = 2 > 1
    assert fit_compressor({"small": [u[:900] for u in ups]}, 1, D, 0.01, min_numel=0).compresses("small")
    # slice sizes per tensor, clamped to the tensor's size
    tiny = [u[:40] for u in ups]
    per = fit_compressor({"w": ups, "x": tiny}, 1, {"w": 8, "x": 100}, 0.5, min_numel=0)
    assert per.basis("w").slice_size == 8 and per.basis("x").slice_size == 40
    with pytest.raises(KeyError, match="'small'"):
        comp.basis("small")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"eps": 1.0}, "eps"),
        ({"eps": -0.1}, "eps"),
        ({"eps": math.nan}, "eps"),
        ({"slice_size": 0}, "slice_size"),
        ({"slice_size": {"w": -1}}, "slice_size"),
        ({"max_dim": 0}, "max_dim"),
        ({"min_numel": -1}, "min_numel"),
        ({"max_samples": 1}, "max_samples"),
        ({"version": 0}, "version"),
    ],
)
def test_fit_rejects_bad_settings(kwargs, key):
    args = {"samples": {"w": low_rank_updates(2, 100, [1.0])}, "version": 1, "slice_size": D, "eps": 0.1, **kwargs}
    with pytest.raises(ConfigError, match=f"^{key}:"):
        fit_compressor(**args)


def test_fit_rejects_samples_of_different_sizes():
    with pytest.raises(ValueError, match="'w'"):
        fit_compressor({"w": [torch.zeros(1600), torch.zeros(1601)]}, 1, D, 0.1)


# --- linearity: what lets the server aggregate coefficients ---------------------------------------


def _clients(n=5, seed=1):
    base = low_rank_updates(n, 80, [5.0, 2.0, 1.0, 0.3], seed=seed, noise=0.05)
    return [u[:-7] for u in base]  # 1273 values: the last slice padded


def test_decompress_once_equals_the_weighted_sum_of_decompressions():
    ups = _clients()
    comp = fit_compressor({"w": low_rank_updates(20, 80, [5.0, 2.0, 1.0, 0.3], seed=9)}, 1, D, 0.05)
    n = ups[0].numel()
    coeffs = [compress(comp, "w", u) for u in ups]
    for weights in ([0.1, 0.3, 0.2, 0.25, 0.15], [12.0, 3.0, 7.0, 1.0, 40.0]):
        summed = sum(w * c for w, c in zip(weights, coeffs))
        once = decompress(comp, "w", summed, n, weight_sum=sum(weights))
        each = sum(w * decompress(comp, "w", c, n) for w, c in zip(weights, coeffs))
        assert float((once - each).norm() / each.norm()) < 1e-5
        agg = aggregate(comp, "w", coeffs, weights, n)
        assert float((agg - once).norm() / once.norm()) < 1e-6
    # weights summing to 1 (FedAvg): the sum of the compressed updates is the compressed mean,
    # and one decompression gives FedAvg's weighted mean of the decompressed updates
    w = torch.tensor([5.0, 1.0, 2.0, 8.0, 4.0])
    w = (w / w.sum()).tolist()
    mean_x = sum(wi * u for wi, u in zip(w, ups))
    summed = sum(wi * c for wi, c in zip(w, coeffs))
    ref = compress(comp, "w", mean_x)
    assert float((summed - ref).norm() / ref.norm()) < 1e-5
    fedavg = sum(wi * decompress(comp, "w", c, n) for wi, c in zip(w, coeffs))
    once = decompress(comp, "w", summed, n)
    assert float((once - fedavg).norm() / fedavg.norm()) < 1e-5


def test_aggregating_wire_coefficients_equals_decoding_each():
    """The server path: coefficients_of on each client's bytes, sum, decompress once."""
    ups = [u.reshape(67, 19) for u in _clients()]
    comp = fit_compressor({"w": [u.reshape(-1) for u in ups]}, 4, D, 0.05)
    codec, spec = GradiVeQ(comp), TensorSpec("w", (67, 19))
    wires = [serde.tensor_from_bytes(serde.tensor_to_bytes(codec.encode(u, "w"))) for u in ups]
    w = [0.2] * 5
    coeffs = [coefficients_of(e, spec, comp) for e in wires]
    once = aggregate(comp, "w", coeffs, w, spec.numel).reshape(spec.shape)
    each = sum(wi * codec.decode(e, spec) for wi, e in zip(w, wires))
    assert float((once - each).norm() / each.norm()) < 1e-5


def test_aggregate_sums_in_float32_whatever_the_coefficients_dtype():
    """Half-precision coefficients are summed in float32: 2048 + 1 is 2049 there, 2048 in float16."""
    comp = Compressor(1, {"w": Basis(torch.eye(4, 1), torch.zeros(4))})
    big, one = torch.tensor([[2048.0]], dtype=torch.float16), torch.tensor([[1.0]], dtype=torch.float16)
    assert aggregate(comp, "w", [big, one], [1.0, 1.0], 4).tolist() == [2049.0, 0.0, 0.0, 0.0]


def test_compress_and_decompress_take_any_float_dtype():
    """The maths is float32 whatever the caller hands over: a float64 update (or float64
    coefficients, as a server summing in double precision has) gives the float32 result."""
    comp = fit_compressor({"w": low_rank_updates(3, 100, [1.0, 0.5])}, 1, D, 0.1)
    x = low_rank_updates(1, 100, [1.0, 0.5], seed=4)[0]
    c = compress(comp, "w", x)
    assert torch.equal(compress(comp, "w", x.double()), c)
    out = decompress(comp, "w", c.double(), x.numel())
    assert out.dtype == torch.float32 and torch.equal(out, decompress(comp, "w", c, x.numel()))
    # one client: the aggregate is that client's decompression, weighted
    torch.testing.assert_close(aggregate(comp, "w", [c], [0.5], x.numel()), 0.5 * decompress(comp, "w", c, x.numel()))


def test_decompress_checks_the_coefficient_shape():
    comp = fit_compressor({"w": low_rank_updates(3, 100, [1.0, 0.5])}, 1, D, 0.1)
    with pytest.raises(ValueError, match="'w'"):
        decompress(comp, "w", torch.zeros(99, comp.basis("w").dim), 1600)
    with pytest.raises(ValueError):
        aggregate(comp, "w", [], [], 1600)


# --- refresh --------------------------------------------------------------------------------------


def test_refresh_bumps_the_version_and_old_coefficients_are_rejected():
    first = refresh_compressor(None, {"w": low_rank_updates(10, 100, [3.0, 1.0], seed=1)}, D, 0.05)
    assert first.version == 1
    second = refresh_compressor(first, {"w": low_rank_updates(10, 100, [3.0, 1.0], seed=2)}, D, 0.05)
    assert second.version == 2 and second.digest != first.digest
    x = low_rank_updates(1, 100, [3.0, 1.0], seed=3)[0]
    old = GradiVeQ(first).encode(x, "w")
    spec = TensorSpec.of("w", x)
    with pytest.raises(PayloadError, match="version 1, this is version 2"):
        GradiVeQ(second).decode(old, spec)
    with pytest.raises(PayloadError, match="version 1"):
        coefficients_of(old, spec, second)
    GradiVeQ(first).decode(old, spec)  # still fine with the compressor it was made for


# --- the broadcast: hostile compressors -----------------------------------------------------------

SPECS = [TensorSpec("w", (40, 40)), TensorSpec("b", (40,))]


def _good_wire():
    comp = fit_compressor({"w": low_rank_updates(4, 100, [2.0, 1.0, 0.5])}, 7, D, 0.01)
    return comp, comp.to_wire()


def _with(wire, **changes):
    t = wire.tensors[0]
    fields = {"name": t.name, "slice_size": t.slice_size, "dim": t.dim, "basis": t.basis, "whitening": t.whitening}
    fields.update(changes)
    return GradiVeQCompressor(wire.version, (GradiVeQBasis(**fields),))


def test_compressor_wire_round_trip():
    comp, wire = _good_wire()
    again = Compressor.from_wire(serde.compressor_from_bytes(serde.compressor_to_bytes(wire)), SPECS)
    assert again.version == 7 and again.digest == comp.digest
    assert torch.equal(again.basis("w").basis, comp.basis("w").basis)
    assert torch.equal(again.basis("w").whitening, comp.basis("w").whitening)
    assert comp.wire_bytes() == len(serde.compressor_to_bytes(wire))
    # dim 0 (dense) entries are accepted and leave the tensor uncompressed
    dense = GradiVeQCompressor(7, wire.tensors + (GradiVeQBasis("b", 0, 0, b"", b""),))
    assert not Compressor.from_wire(dense, SPECS).compresses("b")


def test_hostile_compressors_are_rejected():
    comp, wire = _good_wire()
    t = wire.tensors[0]
    d, k = t.slice_size, t.dim
    nan_basis = bytearray(t.basis)
    nan_basis[0:4] = np.float32(np.nan).tobytes()
    inf_mu = bytearray(t.whitening)
    inf_mu[4:8] = np.float32(np.inf).tobytes()
    big = np.zeros((d, k), np.float32)
    big[0, :] = 3.0  # column norms 3
    cases = {
        "unknown tensor": _with(wire, name="nope"),
        "d == 0": _with(wire, slice_size=0),
        "d > max_slice": _with(wire, slice_size=5000, dim=1, basis=b"\0" * 20000, whitening=b"\0" * 20000),
        "d > numel": _with(wire, slice_size=2000, dim=1),
        "k > d": _with(wire, dim=d + 1),
        "basis too short": _with(wire, basis=t.basis[:-4]),
        "basis too long": _with(wire, basis=t.basis + b"\0" * 4),
        "whitening wrong": _with(wire, whitening=t.whitening[:-1]),
        "nan basis": _with(wire, basis=bytes(nan_basis)),
        "inf whitening": _with(wire, whitening=bytes(inf_mu)),
        "not unit norm": _with(wire, basis=big.tobytes()),
        "dim 0 with data": _with(wire, dim=0),
        "dim 0 with a basis": _with(wire, dim=0, whitening=b""),
        "dim 0 with a whitening": _with(wire, dim=0, basis=b""),
        "huge k, tiny bytes": _with(wire, dim=2**31),
    }
    # what the client's log says for each (exactly: it is the operator's only clue)
    reasons = {
        "unknown tensor": "the compressor names a tensor the model does not have",
        "d == 0": "slice_size 0 must be at least 1",
        "d > max_slice": "slice_size 5000 exceeds the limit 4096",
        "d > numel": "slice_size 2000 exceeds the tensor's 1600 elements",
        "k > d": f"dim {d + 1} is not in [1, slice_size {d}]",
        "basis too short": f"basis is {d * k * 4 - 4} bytes, expected d*k*4 = {d * k * 4}",
        "basis too long": f"basis is {d * k * 4 + 4} bytes, expected d*k*4 = {d * k * 4}",
        "whitening wrong": f"whitening is {d * 4 - 1} bytes, expected d*4 = {d * 4}",
        "nan basis": "basis or whitening holds NaN or infinite values",
        "inf whitening": "basis or whitening holds NaN or infinite values",
        "not unit norm": "basis columns must have unit norm",
        "dim 0 with data": "dim 0 (sent dense) with a non-empty basis or whitening",
        "dim 0 with a basis": "dim 0 (sent dense) with a non-empty basis or whitening",
        "dim 0 with a whitening": "dim 0 (sent dense) with a non-empty basis or whitening",
        "huge k, tiny bytes": f"dim {2**31} is not in [1, slice_size {d}]",
    }
    Compressor.from_wire(wire, SPECS)  # the unaltered one is fine
    for why, bad in cases.items():
        with pytest.raises(PayloadError) as info:
            Compressor.from_wire(bad, SPECS)
        assert (info.value.tensor, info.value.reason) == (bad.tensors[0].name, reasons[why]), why
        # and through real protobuf bytes
        with pytest.raises(PayloadError):
            Compressor.from_wire(serde.compressor_from_bytes(serde.compressor_to_bytes(bad)), SPECS)
    twice = GradiVeQCompressor(7, wire.tensors + wire.tensors)
    with pytest.raises(PayloadError) as info:
        Compressor.from_wire(twice, SPECS)
    assert (info.value.tensor, info.value.reason) == ("w", "the compressor lists the tensor twice")
    for version in (0, 2**64):  # 2**64: only a Python caller can build it (uint64 on the wire)
        with pytest.raises(PayloadError) as info:
            Compressor.from_wire(GradiVeQCompressor(version, wire.tensors), SPECS)
        assert (info.value.tensor, info.value.reason) == ("", f"compressor version {version} is not in [1, 2**64)")
    # what a Python caller (not protobuf) can hand over
    with pytest.raises(PayloadError) as info:
        Compressor.from_wire(wire.tensors[0], SPECS)  # type: ignore[arg-type]
    assert (info.value.tensor, info.value.reason) == ("", "expected a GradiVeQCompressor, got GradiVeQBasis")
    with pytest.raises(PayloadError) as info:
        Compressor.from_wire(_with(wire, slice_size=float(d)), SPECS)
    assert (info.value.tensor, info.value.reason) == ("w", "slice_size and dim must be integers")
    with pytest.raises(PayloadError):
        Compressor.from_wire(serde.compressor_from_bytes(b"\x0a\xff\xff"), SPECS)
    with pytest.raises(PayloadError, match="max_slice|limit"):
        Compressor.from_wire(wire, SPECS, max_slice=D - 1)


def _unit_basis(name: str, d: int, k: int) -> GradiVeQBasis:
    """The first k columns of the d x d identity (unit norm, orthonormal), whitening zero."""
    u = np.eye(d, k, dtype=np.float32)
    return GradiVeQBasis(name, d, k, u.tobytes(), np.zeros(d, np.float32).tobytes())


@pytest.mark.parametrize(
    "version, name, d, k",
    [
        (1, "b", 4, 2),  # the lowest version
        (2**64 - 1, "b", 4, 2),  # the highest (uint64 on the wire)
        (3, "b", 1, 1),  # slices of one element
        (3, "b", 5, 5),  # k == d: no reduction, still valid
        (3, "b", 40, 3),  # d == the tensor's numel: one slice
        (3, "w", 64, 1),  # d == max_slice (set to 64 here)
    ],
)
def test_compressor_limits_are_inclusive(version, name, d, k):
    """Every bound ``from_wire`` checks admits its edge value: a server may send exactly that."""
    wire = GradiVeQCompressor(version, (_unit_basis(name, d, k),))
    comp = Compressor.from_wire(serde.compressor_from_bytes(serde.compressor_to_bytes(wire)), SPECS, max_slice=64)
    assert comp.version == version and (comp.basis(name).slice_size, comp.basis(name).dim) == (d, k)
    assert torch.equal(comp.basis(name).basis, torch.eye(d, k))


def test_compressor_constructor_checks_its_bases():
    u = torch.linalg.qr(torch.randn(8, 3))[0]
    Compressor(1, {"w": Basis(u, torch.zeros(8))})
    Compressor(1, {"w": Basis(torch.ones(1, 1), torch.zeros(1))})  # d = k = 1: the smallest basis
    for u_bad, mu_bad in ((torch.zeros(4), torch.zeros(4)), (u, torch.zeros(8, 1))):  # a vector basis, a matrix mu
        with pytest.raises(ConfigError) as info:
            Compressor(1, {"w": Basis(u_bad, mu_bad)})
        assert str(info.value) == "w: basis must be a float32 d x k matrix and whitening a float32 d-vector"
    with pytest.raises(ConfigError):
        Compressor(1, {"w": Basis(u.double(), torch.zeros(8))})
    with pytest.raises(ConfigError):
        Compressor(1, {"w": Basis(u, torch.zeros(7))})
    with pytest.raises(ConfigError):
        Compressor(1, {"w": Basis(u.t().contiguous(), torch.zeros(3))})  # k > d
    for bad in (0, 2**64, True, 1.0):
        with pytest.raises(ConfigError) as info:
            Compressor(bad, {})  # type: ignore[arg-type]
        assert str(info.value) == f"version: must be an integer in [1, 2**64), got {bad!r}"
    assert Compressor(2**64 - 1, {}).version == 2**64 - 1  # the largest a payload can quote (uint64)


# --- secure aggregation: Flower's SecAgg+ primitives on coefficients --------------------------------


def test_secaggplus_masked_sum_of_coefficients_decompresses_to_the_aggregate():
    """Replays what flwr's secaggplus_mod (client) and SecAggPlusWorkflow (server) do to the
    arrays, with Flower 1.41's own primitives: weight by num_examples / max_weight, clip and
    quantize, add a private mask and pairwise masks, sum mod 2**32 on the server, remove the
    private masks from seeds rebuilt from Shamir shares, dequantize. The unmasked result is the
    weighted mean of the clients' coefficients; one decompression of it is FedAvg's mean of the
    decompressed updates, within the quantization error (docs/GRADIVEQ.md)."""
    secagg = pytest.importorskip("flwr.common.secure_aggregation.ndarrays_arithmetic")
    from flwr.common.secure_aggregation.crypto.shamir import (
        combine_shares,
        create_shares,
    )
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.quantization import dequantize, quantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import generate_key_pairs

    clip, target, mod, max_weight, threshold = 8.0, 1 << 22, 1 << 32, 1000.0, 3
    ups = _clients(4, seed=5)
    comp = fit_compressor({"w": low_rank_updates(20, 80, [5.0, 2.0, 1.0, 0.3], seed=6)}, 1, D, 0.05)
    n = ups[0].numel()
    coeffs = [compress(comp, "w", u).numpy().astype(np.float64) for u in ups]
    assert max(float(np.abs(c).max()) for c in coeffs) < clip  # else the clip would bite
    examples = [120, 300, 75, 505]
    keys = [generate_key_pairs() for _ in ups]
    seeds = [bytes([i + 1]) * 32 for i in range(len(ups))]
    shares = [create_shares(s, threshold, len(ups)) for s in seeds]

    masked = []
    for i, c in enumerate(coeffs):  # client i (secaggplus_mod._collect_masked_vectors)
        q_ratio = round(examples[i] / max_weight * target)
        q = quantize(secagg.parameters_multiply([c], q_ratio / target), clip, target)
        q = secagg.factor_combine(q_ratio, q)
        shape = secagg.get_parameters_shape(q)
        q = secagg.parameters_addition(q, pseudo_rand_gen(seeds[i], mod, shape))
        for j in range(len(ups)):
            if j == i:
                continue
            pair = pseudo_rand_gen(generate_shared_key(keys[i][0], keys[j][1]), mod, shape)
            q = (secagg.parameters_addition if i > j else secagg.parameters_subtraction)(q, pair)
        masked.append(secagg.parameters_mod(q, mod))
    assert masked[0][1].dtype == np.int64  # 8 bytes per coefficient on the wire, not 4

    total = masked[0]  # server (SecAggPlusWorkflow.unmask_stage): the sum hides each vector
    for m in masked[1:]:
        total = secagg.parameters_addition(total, m)
    for i in range(len(ups)):
        seed = combine_shares(shares[i][:threshold])
        assert seed == seeds[i]
        total = secagg.parameters_subtraction(total, pseudo_rand_gen(seed, mod, secagg.get_parameters_shape(total)))
    q_total, rest = secagg.factor_extract(secagg.parameters_mod(total, mod))
    mean_coeffs = (dequantize(rest, clip, target)[0] - (len(ups) - 1) * clip) * (target / q_total)

    w = [e / sum(examples) for e in examples]
    exact = sum(wi * c for wi, c in zip(w, coeffs))
    step = 2 * clip / target  # one quantization step, scaled by 1 / sum of the weights
    assert np.abs(mean_coeffs - exact).max() < 4 * step * max_weight / sum(examples)
    agg = decompress(comp, "w", torch.from_numpy(mean_coeffs).float(), n)  # weight_sum 1: a mean
    fedavg = sum(wi * decompress(comp, "w", torch.from_numpy(c).float(), n) for wi, c in zip(w, coeffs))
    assert float((agg - fedavg).norm() / fedavg.norm()) < 1e-4


def test_importing_fedcomp_gradiveq_first_works():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import fedcomp.methods.gradiveq"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
