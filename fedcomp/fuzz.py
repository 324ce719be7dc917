"""Fuzz the receiving side: mutated payloads of every codec, and mutated Flower replies.

``python -m fedcomp.fuzz --n 100000 --replies 1000 --json F [--seed S]``

**Payloads** (``--n``): real updates of a real model (LeNet-5, 431,080 parameters, by default),
one per codec (SBC, STC, 3LC, top-k fp32/fp16, GradiVeQ, dense fp32/fp16, identity; tensors below
1,000 elements dense-fp32, as ``UpdateEncoder`` sends them), are mutated (truncations, bit flips,
byte overwrites, protobuf field values: oversized counts, NaN/inf/huge floats, zero-run bombs,
wrong names, shapes, codecs, dtypes; tensors dropped, repeated, swapped, a million tiny tensors;
random bytes and random protobuf) and decoded as a server does: ``update_from_bytes`` (with the
model's tensors for even inputs, without for odd ones, as a new client's full replica is parsed)
then ``decode_update``. Most mutations are *resealed* (the CRC recomputed) so that they reach the
decoders behind the checksum; the ``raw-*`` kinds are not, and show what the checksum catches.

**Replies** (``--replies``): a live federation, ``CompressionStrategy(FedAvg)`` and three clients
running the real ``compression_mod`` around a deterministic fake training, built as
``tests/flower/helpers.py`` builds it. Each input is one train round (every fifth also an
evaluate round) in which one reply's structure is mutated: records dropped, added, renamed or
retyped (extra ArrayRecords, missing or extra MetricRecords and ConfigRecords), every key of the
uplink record dropped or its value retyped (``replica-version`` non-integer, negative, huge; the
payload not bytes, truncated, resealed garbage), ``num-examples`` -10, 0, 1, 1e15, NaN, inf, a
string, missing; error replies; replies swapped or repeated between nodes. A *run ended* is any
exception escaping ``aggregate_train`` or ``aggregate_evaluate`` (the federation is then rebuilt).

Outcomes per input: ``decoded`` (accepted), ``rejected`` (a typed :class:`PayloadError` or
:class:`ConfigError`), ``other_exception`` (anything else: a bug), and, counted on top,
``over_time`` (more than 1 s per MB of the input or of the model, whichever is larger) and
``over_memory`` (decoding the input made the process's peak resident memory grow by more than twice
the model's float32 size: :class:`PeakMemory`). A
round of the replies fuzz is over time past 1 s; its memory is not judged (its model is 12.8 kB,
below what resident-memory measurement resolves). Torch runs on one thread meanwhile. The
JSON also has the seed, the time, counts per mutation kind and the slowest inputs; exceptions of
the ``other`` kind are kept with the mutation that made them (and the input, hex, when small).

**What the memory figure counts.** The growth of the process's peak resident memory from just
before ``update_from_bytes`` to just after ``decode_update`` returns: everything the parse and the
decode allocate and touch (protobuf's copies, payload bytes, codec buffers, the decoded tensors),
at its peak. The input bytes are not counted (they are resident before the decode starts, as a
received message is), nor are the fuzzer's own checks after the decode. Linux's ``VmHWM`` is reset
before each input; glibc's malloc is set to serve every block of 64 kB or more by a fresh ``mmap``
and return it on ``free`` (``mallopt``), so each large buffer counts once its pages are touched,
whatever earlier inputs left in the heap. (With glibc's default adaptive threshold the same decode
measured anywhere from 0x, its buffers recycled from an earlier input's heap, to 4x.) Not measured
off Linux. The inputs the report lists (over memory, slowest, unexpected) carry their index:
``--input I`` decodes input ``I`` of the same seed and model alone and prints its figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from fedcomp.codecs import SBC, STC, Codec, DenseFP16, DenseFP32, GradiVeQ, Identity, TensorSpec, ThreeLC, TopK
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.v1 import wire_pb2 as pb
from fedcomp.wire import serde

TYPED = (PayloadError, ConfigError)
#: Time budget per input: this many seconds per MB of max(input, model).
SECONDS_PER_MB = 1.0
#: Memory budget per input: peak RSS growth at most this many times the model's fp32 bytes.
MEMORY_FACTOR = 2.0
SLOWEST = 10
#: The report keeps this many of the inputs over the memory bound, the worst first.
WORST = 20
#: Inputs up to this size are kept (hex) with an unexpected exception, as a repro.
KEEP_INPUT_BYTES = 4096


# --- measuring one input ---------------------------------------------------------------------------


#: Blocks of at least this many bytes get their own ``mmap`` while :class:`PeakMemory` measures.
MMAP_THRESHOLD = 64 * 1024


def _libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, absent elsewhere
    except (OSError, AttributeError):
        return None
    return libc


def fix_malloc_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc's malloc ``mmap`` every new block of ``threshold`` bytes or more and unmap it on
    ``free`` (and trim the heap past ``threshold``), for the rest of the process: then a large
    buffer's pages count in the resident size exactly while it lives, instead of being recycled
    from (or returned to) a heap an earlier input shaped. False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(libc.mallopt(m_trim_threshold, threshold))


def _keep_worst(entries: list[dict[str, Any]], entry: dict[str, Any], key: str, n: int) -> None:
    """Add ``entry``; keep the list to about the ``n`` largest by ``key`` (trimmed in batches, so
    each input costs O(1) amortised; the report sorts and cuts it)."""
    entries.append(entry)
    if len(entries) > 4 * n:
        entries.sort(key=lambda e: -e[key])
        del entries[n:]


class PeakMemory:
    """Peak resident-memory growth of this process across a block, via Linux's ``VmHWM``
    (reset by writing 5 to ``/proc/self/clear_refs``). ``available`` is False elsewhere.
    Fixes glibc's mmap threshold (:func:`fix_malloc_threshold`) so the figure does not depend on
    what earlier blocks left in the heap; ``malloc_fixed`` says whether that worked."""

    def __init__(self) -> None:
        self.available = True
        try:
            self._reset()
            self._read("VmHWM")
        except OSError:
            self.available = False
        self.malloc_fixed = fix_malloc_threshold() if self.available else False
        self._libc = _libc() if self.malloc_fixed else None

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _read(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {key} in /proc/self/status")

    def start(self) -> int:
        """Begin a block: free heap pages are given back to the kernel first (``malloc_trim``), so
        a block that reuses a free heap chunk touches fresh pages and counts them too."""
        if not self.available:
            return 0
        if self._libc is not None:
            self._libc.malloc_trim(0)
        self._reset()
        return self._read("VmRSS")

    def growth(self, start: int) -> int | None:
        return self._read("VmHWM") - start if self.available else None


@dataclass
class Tally:
    """Counts per outcome and per mutation kind, the slowest inputs, the unexpected exceptions."""

    budget_bytes: int
    #: Inputs smaller than this get its time budget (a round of the replies fuzz: 1 s).
    floor_bytes: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    slowest: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[dict[str, Any]] = field(default_factory=list)
    over_memory: list[dict[str, Any]] = field(default_factory=list)
    rejections: Counter[str] = field(default_factory=Counter)
    max_seconds_per_mb: float = 0.0
    max_memory_factor: float = 0.0
    seconds: float = 0.0

    def add(
        self,
        kind: str,
        outcome: str,
        seconds: float,
        size: int,
        grew: int | None,
        detail: str,
        data: bytes = b"",
        index: int | None = None,
        codec: str | None = None,
    ) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        self.seconds += seconds
        mb = max(size, self.budget_bytes, self.floor_bytes) / 1e6
        self.max_seconds_per_mb = max(self.max_seconds_per_mb, seconds / mb)
        if seconds > SECONDS_PER_MB * mb:
            self.outcomes["over_time"] += 1
            self.by_kind[kind]["over_time"] += 1
        if grew is not None:
            factor = grew / self.budget_bytes
            self.max_memory_factor = max(self.max_memory_factor, factor)
            if factor > MEMORY_FACTOR:
                self.outcomes["over_memory"] += 1
                self.by_kind[kind]["over_memory"] += 1
                # the worst ones (by factor) are kept, each with what replays it (--input)
                entry = {
                    "index": index,
                    "codec": codec,
                    "kind": kind,
                    "bytes": size,
                    "factor": round(factor, 3),
                    "outcome": outcome,
                    "detail": detail[:120],
                }
                _keep_worst(self.over_memory, entry, "factor", WORST)
        if outcome == "rejected":
            self.rejections[detail.split(":")[0][:60]] += 1
        if outcome in ("other_exception", "run_ended") and len(self.unexpected) < 50:
            item: dict[str, Any] = {"index": index, "kind": kind, "outcome": outcome, "error": detail}
            if len(data) <= KEEP_INPUT_BYTES:
                item["input_hex"] = data.hex()
            self.unexpected.append(item)
        entry = {
            "index": index,
            "kind": kind,
            "bytes": size,
            "seconds": round(seconds, 6),
            "outcome": outcome,
            "detail": detail[:160],
        }
        _keep_worst(self.slowest, entry, "seconds", SLOWEST)

    def report(self) -> dict[str, Any]:
        self.slowest.sort(key=lambda e: -e["seconds"])
        return {
            "outcomes": dict(self.outcomes),
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "top_rejection_reasons": dict(self.rejections.most_common(25)),
            "slowest": self.slowest[:SLOWEST],
            "unexpected": self.unexpected,
            "over_memory_inputs": sorted(self.over_memory, key=lambda e: -e["factor"])[:WORST],
            "max_seconds_per_mb": self.max_seconds_per_mb,
            "max_memory_factor": self.max_memory_factor,
            "seconds_in_inputs": self.seconds,
        }


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- payloads --------------------------------------------------------------------------------------


def lenet_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of the SBC paper's LeNet-5 (the app's model), seeded."""
    from fedcomp.app.models import LeNet5Caffe

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in LeNet5Caffe().state_dict().items()}


def small_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """The Flower tests' model: two tensors above ``min-compress-numel`` and a bias below."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(40, 50, generator=g) * 0.1,
        "w2": torch.randn(1200, generator=g) * 0.1,
        "b": torch.randn(10, generator=g) * 0.1,
    }


MODELS: dict[str, Callable[[int], dict[str, torch.Tensor]]] = {"lenet": lenet_model, "small": small_model}


def _gradiveq(model: Mapping[str, torch.Tensor], rng: torch.Generator) -> GradiVeQ:
    from fedcomp.methods.gradiveq import fit_compressor

    samples = {k: [torch.randn(v.shape, generator=rng) * 0.01 for _ in range(4)] for k, v in model.items()}
    return GradiVeQ(fit_compressor(samples, 1, 64, eps=0.5))


@dataclass
class Corpus:
    """One real update per codec, and what decodes them."""

    specs: list[TensorSpec]
    model_bytes: int
    seeds: dict[str, bytes]
    receivers: dict[str, list[Codec]]


def build_corpus(model: Mapping[str, torch.Tensor], seed: int, only: Collection[str] | None = None) -> Corpus:
    """The seed updates of ``model`` (one per codec, or only the codecs named in ``only``)."""
    g = torch.Generator().manual_seed(seed)
    delta = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in model.items()}
    makers: dict[str, Callable[[], Codec]] = {
        "sbc": lambda: SBC(p=0.01),
        "stc": lambda: STC(p=0.01),
        "3lc": ThreeLC,
        "topk": lambda: TopK(p=0.01),
        "topk-fp16": lambda: TopK(p=0.01, values="float16"),
        "gradiveq": lambda: _gradiveq(model, g),
        "dense-fp32": DenseFP32,
        "dense-fp16": DenseFP16,
        "identity": Identity,
    }
    codecs = {name: make() for name, make in makers.items() if only is None or name in only}
    seeds: dict[str, bytes] = {}
    receivers: dict[str, list[Codec]] = {}
    for name, codec in codecs.items():
        enc = UpdateEncoder(codec, error_feedback=False)
        seeds[name] = serde.update_to_bytes(enc.encode(delta, base_model_version=3))
        receivers[name] = [codec] if isinstance(codec, DenseFP32) else [codec, DenseFP32()]
    nbytes = sum(4 * t.numel() for t in model.values())
    return Corpus(specs_of(model), nbytes, seeds, receivers)


_INTS = (0, 1, 2, 7, 62, 63, 64, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
_FLOATS = (math.nan, math.inf, -math.inf, 3e38, -3e38, 3.4028235e38, 65520.0, -0.0, 0.0, 1e-45, -1.0, 1e30)


def _flip_bits(data: bytes, rng: random.Random, count: int) -> bytes:
    out = bytearray(data)
    for _ in range(count):
        if out:
            bit = rng.randrange(8 * len(out))
            out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _body(data: bytes) -> bytes:
    return data[:-5]


def _mutate_field(msg: Any, rng: random.Random, numel: int) -> str:
    """Set one scalar, bytes or repeated field of ``msg`` (a protobuf message) to a hostile value;
    return what was done."""
    fields = [f for f in msg.DESCRIPTOR.fields if f.message_type is None]
    f = rng.choice(fields)
    name = f.name
    if f.is_repeated:  # shape
        getattr(msg, name)[:] = rng.choice([[], [numel * 2], [2**62], [1] * 9, [0], [2**32, 2**32], [numel, 1]])
        return f"{name}=changed"
    if f.type in (f.TYPE_FLOAT, f.TYPE_DOUBLE):
        v = rng.choice(_FLOATS)
        setattr(msg, name, v)
        return f"{name}={v}"
    if f.type == f.TYPE_BOOL:
        setattr(msg, name, not getattr(msg, name))
        return f"{name}=flipped"
    if f.type == f.TYPE_STRING:
        text = rng.choice(["", "x", "dense-fp32", "sbc", "3lc", "topk", "conv1.weight", "\u00e9" * 300])
        setattr(msg, name, text)
        return f"{name}={text[:12]!r}"
    if f.type == f.TYPE_BYTES:
        old = getattr(msg, name)
        how = rng.randrange(7)
        if how == 0:
            blob, what = old[: rng.randrange(len(old) + 1)], "truncated"
        elif how == 1:
            blob, what = old + rng.randbytes(rng.randrange(1, 64)), "extended"
        elif how == 2:
            blob, what = b"", "empty"
        elif how == 3:
            blob, what = b"\xff" * rng.choice([1, 100, 10_000, 200_000]), "zero-run bomb / ones"
        elif how == 4:
            blob, what = rng.randbytes(len(old)), "random same length"
        elif how == 5:
            blob, what = (
                (b"\x7f\xc0\x00\x00" if rng.random() < 0.5 else b"\x7f\x80\x00\x00") * max(1, len(old) // 4),
                "NaN/inf",
            )
        else:
            blob, what = old * 2, "doubled"
        setattr(msg, name, blob)
        return f"{name}={what}"
    if f.type == f.TYPE_ENUM:
        v = rng.choice([0, 1, 2, 3, 4, 5, 99])
        setattr(msg, name, v)
        return f"{name}={v}"
    width = 32 if f.type in (f.TYPE_UINT32, f.TYPE_FIXED32) else 64
    v = rng.choice([*_INTS, numel, numel + 1, numel - 1, numel * 10]) % (1 << width)
    setattr(msg, name, v)
    return f"{name}={v}"


def _structural(data: bytes, rng: random.Random, numel: Sequence[int]) -> tuple[str, bytes]:
    """Mutate a parsed update's structure or one field, reseal it."""
    msg = pb.CompressedUpdate()
    msg.ParseFromString(data)
    msg.ClearField("crc32")
    n = len(msg.tensors)
    how = rng.randrange(10)
    if how == 0 and n:
        del msg.tensors[rng.randrange(n)]
        kind = "tensor-dropped"
    elif how == 1 and n:
        msg.tensors.append(msg.tensors[rng.randrange(n)])
        kind = "tensor-repeated"
    elif how == 2 and n > 1:
        i, j = rng.sample(range(n), 2)
        a, b = pb.CompressedTensor(), pb.CompressedTensor()
        a.CopyFrom(msg.tensors[i])
        b.CopyFrom(msg.tensors[j])
        msg.tensors[i].CopyFrom(b)
        msg.tensors[j].CopyFrom(a)
        kind = "tensors-swapped"
    elif how == 3:
        msg.format_version = rng.choice([0, 1, 3, 2**32 - 1])
        kind = "format-version"
    elif how == 4:
        msg.base_model_version = rng.choice(_INTS)
        kind = "base-version"
    else:
        i = rng.randrange(n)
        t = msg.tensors[i]
        if rng.random() < 0.3:
            what = _mutate_field(t, rng, numel[i] if i < len(numel) else 1)
        else:
            payload = getattr(t, t.WhichOneof("payload"))
            what = _mutate_field(payload, rng, numel[i] if i < len(numel) else 1)
        kind = "field:" + what.split("=")[0]
    return kind, serde.seal(msg.SerializeToString(deterministic=True))


def _random_update(rng: random.Random) -> bytes:
    """A random but well-formed CompressedUpdate (random tensors of random codecs)."""
    msg = pb.CompressedUpdate(format_version=2, base_model_version=rng.choice(_INTS))
    for _ in range(rng.randrange(6)):
        t = msg.tensors.add()
        t.name = rng.choice(["conv1.weight", "fc1.weight", "x", ""])
        t.shape[:] = [rng.choice([1, 5, 20, 500, 2**40]) for _ in range(rng.randrange(4))]
        t.dtype = rng.randrange(6)
        t.codec_id = rng.choice([*serde.PAYLOAD_OF_CODEC, "zstd"])
        t.codec_version = rng.choice([0, 1, 2])
        kind = rng.choice(["sbc", "stc", "three_lc", "dense", "sparse", "gradiveq"])
        payload = getattr(t, kind)
        payload.SetInParent()
        for _ in range(rng.randrange(1, 5)):
            _mutate_field(payload, rng, 1000)
    return serde.seal(msg.SerializeToString(deterministic=True))


def mutations(corpus: Corpus, rng: random.Random) -> Iterator[tuple[str, str, bytes]]:
    """Endless ``(codec, kind, bytes)``: a seed update of a random codec, mutated."""
    codecs = sorted(corpus.seeds)
    numel = [s.numel for s in corpus.specs]
    tiny = b"\x1a\x06\x18\x01\x62\x02\x08\x01"
    while True:
        codec = rng.choice(codecs)
        data = corpus.seeds[codec]
        r = rng.random()
        if r < 0.05:
            yield codec, "unmutated", data
        elif r < 0.12:
            yield codec, "raw-truncated", data[: rng.randrange(len(data))]
        elif r < 0.22:
            yield codec, "raw-bitflip", _flip_bits(data, rng, rng.choice([1, 1, 2, 3, 8]))
        elif r < 0.27:
            cut = rng.randrange(len(data) - 4)
            yield codec, "truncated-resealed", serde.seal(_body(data)[:cut])
        elif r < 0.42:
            yield codec, "bitflip-resealed", serde.seal(_flip_bits(_body(data), rng, rng.choice([1, 1, 2, 4, 16])))
        elif r < 0.50:
            body = bytearray(_body(data))
            at = rng.randrange(len(body))
            span = rng.randbytes(rng.randrange(1, 33))
            body[at : at + len(span)] = span
            yield codec, "overwrite-resealed", serde.seal(bytes(body))
        elif r < 0.85:
            kind, out = _structural(data, rng, numel)
            yield codec, kind, out
        elif r < 0.90:
            yield "-", "random-protobuf", _random_update(rng)
        elif r < 0.95:
            raw = rng.randbytes(rng.randrange(0, 2048))
            yield (
                "-",
                "random-bytes" + ("-sealed" if rng.random() < 0.5 else ""),
                (serde.seal(raw) if rng.random() < 0.5 else raw),
            )
        else:
            count = rng.choice([4, 100, 10_000, 200_000, 1_600_000])
            yield "-", "many-tiny-tensors", serde.seal(b"\x08\x02" + tiny * count)


def decode_as_server(corpus: Corpus, codec: str, data: bytes, with_model: bool) -> dict[str, torch.Tensor]:
    """What a receiver does with an uplink: parse (bounded by the model, or not), decode."""
    update = serde.update_from_bytes(data, expected=corpus.specs if with_model else None)
    receivers = corpus.receivers.get(codec) or [c for cs in corpus.receivers.values() for c in cs[:1]]
    return decode_update(update, corpus.specs, receivers)


@dataclass
class Decoded:
    """What decoding one input gave: the outcome, the reason or exception, seconds, memory growth
    in bytes (None where not measured), and whether a decoded tensor holds NaN or infinity."""

    outcome: str
    detail: str
    seconds: float
    grew: int | None
    nonfinite: bool = False


def decode_one(corpus: Corpus, codec: str, data: bytes, with_model: bool, memory: PeakMemory) -> Decoded:
    """Decode one input as a server does, timed and measured from the parse to the decoded
    tensors (the module docstring says what is counted); classify what happened."""
    base = memory.start()
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] | None = None
    try:
        tensors = decode_as_server(corpus, codec, data, with_model=with_model)
        outcome, detail = "decoded", ""
    except TYPED as exc:
        outcome, detail = "rejected", str(getattr(exc, "reason", exc))
    except Exception as exc:
        outcome, detail = "other_exception", _describe(exc) + " | " + traceback.format_exc(limit=-3)
    seconds, grew = time.perf_counter() - t0, memory.growth(base)
    nonfinite = tensors is not None and any(not bool(torch.isfinite(t).all()) for t in tensors.values())
    return Decoded(outcome, detail, seconds, grew, nonfinite)


def payload_input(seed: int, model_name: str, index: int) -> tuple[Corpus, str, str, bytes]:
    """``(corpus, codec, kind, bytes)`` of input number ``index`` of ``fuzz_payloads(seed=seed,
    model_name=model_name)``: the same mutation stream, replayed (a repro for one input)."""
    corpus = build_corpus(MODELS[model_name](seed), seed)
    source = mutations(corpus, random.Random(seed))
    for _ in range(index):
        next(source)
    codec, kind, data = next(source)
    return corpus, codec, kind, data


def fuzz_payloads(
    n: int, seed: int, model_name: str = "lenet", progress: bool = False, detail_by_codec: bool = False
) -> dict[str, Any]:
    """Decode ``n`` mutated updates as a server does (module docstring); the report's dict.
    ``detail_by_codec``: count per mutation kind and codec rather than per kind."""
    rng = random.Random(seed)
    model = MODELS[model_name](seed)
    corpus = build_corpus(model, seed)
    tally = Tally(corpus.model_bytes)
    memory = PeakMemory()
    nonfinite = 0
    source = mutations(corpus, rng)  # payload_input replays this stream: keep the two in step
    t_start = time.perf_counter()
    for i in range(n):
        codec, kind, data = next(source)
        d = decode_one(corpus, codec, data, i % 2 == 0, memory)
        nonfinite += d.nonfinite
        label = f"{kind} [{codec}]" if detail_by_codec else kind
        tally.add(label, d.outcome, d.seconds, len(data), d.grew, d.detail, data, index=i, codec=codec)
        if progress and (i + 1) % 10_000 == 0:
            print(f"payloads: {i + 1}/{n} ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    out = tally.report()
    out.update(
        model=model_name,
        model_bytes=corpus.model_bytes,
        inputs=n,
        decoded_with_nonfinite_values=nonfinite,
        memory_measured=memory.available,
        malloc_threshold_fixed=memory.malloc_fixed,
        seed_update_bytes={k: len(v) for k, v in sorted(corpus.seeds.items())},
        seconds=time.perf_counter() - t_start,
    )
    return out


def decode_memory(
    codecs: Collection[str], model_name: str = "lenet", seed: int = 0, repeats: int = 3
) -> dict[str, float]:
    """The most memory decoding each named codec's seed update takes (parse and decode, with and
    without the model's tensors, ``repeats`` times each), as a multiple of the model's fp32 size:
    the figure the payload fuzz bounds by ``MEMORY_FACTOR``. Needs Linux (``VmHWM``); fixes glibc's
    malloc threshold for the rest of the process (:class:`PeakMemory`), so run it in a process of
    its own."""
    memory = PeakMemory()
    if not memory.available:
        raise OSError("peak resident memory is not measurable here (Linux's /proc/self/status)")
    corpus = build_corpus(MODELS[model_name](seed), seed, only=codecs)
    worst: dict[str, float] = {}
    for codec, data in corpus.seeds.items():
        for i in range(2 * repeats):
            d = decode_one(corpus, codec, data, i % 2 == 0, memory)
            if d.outcome != "decoded" or d.grew is None:
                raise RuntimeError(f"{codec}: its own update gave {d.outcome} ({d.detail[:200]})")
            worst[codec] = max(worst.get(codec, 0.0), d.grew / corpus.model_bytes)
    return worst


def replay_input(seed: int, model_name: str, index: int) -> dict[str, Any]:
    """Decode input ``index`` of a payload fuzz alone (``--input``): its kind, size, outcome,
    seconds and memory factor, and the input itself (hex) when small."""
    corpus, codec, kind, data = payload_input(seed, model_name, index)
    memory = PeakMemory()
    d = decode_one(corpus, codec, data, index % 2 == 0, memory)
    out: dict[str, Any] = {
        "index": index,
        "codec": codec,
        "kind": kind,
        "bytes": len(data),
        "with_model": index % 2 == 0,
        "outcome": d.outcome,
        "detail": d.detail,
        "seconds": d.seconds,
        "memory_factor": None if d.grew is None else d.grew / corpus.model_bytes,
    }
    if len(data) <= KEEP_INPUT_BYTES:
        out["input_hex"] = data.hex()
    return out


# --- replies ---------------------------------------------------------------------------------------


def _task_identity() -> Callable[[], None]:
    """Set what a Flower process has set before any Message is built; return the undo."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = {a: TaskIdentity.__dict__.get(a) for a in ("_run_id", "_node_id", "_task_id")}
    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        setattr(TaskIdentity, attr, value)

    def undo() -> None:
        for a, v in saved.items():
            setattr(TaskIdentity, a, v)

    return undo


class Federation:
    """``CompressionStrategy(FedAvg)`` and clients running ``compression_mod`` around a fake
    training that adds a seeded delta, as ``tests/flower/helpers.py`` builds them."""

    NODES = (1, 2, 3)

    def __init__(self, seed: int, run_config: Mapping[str, Any] | None = None) -> None:
        from flwr.app import Context, RecordDict
        from flwr.serverapp.strategy import FedAvg

        from fedcomp.flower.settings import CompressionConfig
        from fedcomp.flower.strategy import CompressionStrategy

        inner = FedAvg(
            fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1
        )
        self.strategy = CompressionStrategy(inner, CompressionConfig.from_run_config(dict(run_config or {})))
        self.strategy.ends_empty_runs = False  # (rounds of only mutated replies are the point here)
        self.model = small_model(seed)
        self.seed = seed
        self.round = 0
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in self.NODES
        }

    def _app(self, msg: Any, ctx: Any) -> Any:
        from flwr.app import Message, MessageType, MetricRecord, RecordDict

        from fedcomp.flower import protocol
        from fedcomp.flower.records import record_from_tensors, tensors_from_record

        received = tensors_from_record(msg.content.array_records["arrays"])
        config = msg.content.config_records.get(protocol.CONFIG_RECORD)
        rnd = int(config[protocol.SERVER_ROUND]) if config is not None else -1  # type: ignore[arg-type]
        node = ctx.node_id
        examples = 10 + node
        if msg.metadata.message_type == MessageType.TRAIN:
            g = torch.Generator().manual_seed(100_003 * node + rnd + self.seed)
            trained = {k: v + torch.randn(v.shape, generator=g) * 0.01 for k, v in received.items()}
            content = RecordDict(
                {"arrays": record_from_tensors(trained), "metrics": MetricRecord({"num-examples": examples})}
            )
        else:
            loss = float(sum(float(t.abs().sum()) for t in received.values()))
            content = RecordDict({"metrics": MetricRecord({"num-examples": examples, "loss": loss})})
        return Message(content, reply_to=msg)

    def replies(self, train: bool) -> tuple[list[Any], list[Any]]:
        """The server's messages for this round and the clients' (unmutated) replies."""
        from flwr.app import ConfigRecord

        from fedcomp.flower.mod import compression_mod
        from fedcomp.flower.records import record_from_tensors

        grid = cast(Any, _Grid(self.NODES))  # duck-typed: configure_* only asks for the node ids
        arrays = record_from_tensors(self.model)
        if train:
            msgs = list(self.strategy.configure_train(self.round, arrays, ConfigRecord({"lr": 0.1}), grid))
        else:
            msgs = list(self.strategy.configure_evaluate(self.round, arrays, ConfigRecord({}), grid))
        out = [compression_mod(m, self.contexts[m.metadata.dst_node_id], self._app) for m in msgs]
        return msgs, out

    def aggregate(self, train: bool, replies: list[Any]) -> None:
        from fedcomp.flower.records import tensors_from_record

        if train:
            arrays, _ = self.strategy.aggregate_train(self.round, replies)
            if arrays is not None:
                self.model = tensors_from_record(arrays)
        else:
            self.strategy.aggregate_evaluate(self.round, replies)


class _Grid:
    """The part of Flower's Grid a strategy's configure_* reads: the connected nodes."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


_NUM_EXAMPLES = (-10, 0, 1, 10**15, math.nan, math.inf, -math.inf, "12", True, 1.5, 2**63 - 1, -(2**63), 1e308)
_ODD_VALUES: tuple[Any, ...] = (
    -1,
    0,
    2**63 - 1,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    "x",
    "",
    True,
    False,
    b"",
    b"\x00" * 7,
    [1, 2],
    ["a"],
    [b"x"],
    [1.5],
    [True],
)


def _mutate_reply(rng: random.Random, request: Any, reply: Any, others: list[Any]) -> tuple[str, Any]:
    """One structural mutation of ``reply`` (the answer to ``request``); returns (kind, message)."""
    from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

    from fedcomp.flower import protocol
    from fedcomp.flower.records import record_from_tensors

    if not reply.has_content():
        return "error-reply-kept", reply
    items = dict(reply.content.items())
    how = rng.randrange(14)
    kind = ""
    if how == 0:
        key = rng.choice(list(items))
        del items[key]
        kind = f"record-dropped:{type(reply.content[key]).__name__}"
    elif how == 1:
        items[rng.choice(["arrays", "extra", protocol.UPLINK + "x"])] = record_from_tensors({"w1": torch.zeros(3)})
        kind = "record-added:ArrayRecord"
    elif how == 2:
        items["metrics2"] = MetricRecord({"num-examples": 5})
        kind = "record-added:MetricRecord"
    elif how == 3:
        items[rng.choice(["config", "extra"])] = ConfigRecord({"a": 1})
        kind = "record-added:ConfigRecord"
    elif how == 4:
        key = rng.choice(list(items))
        rec = items.pop(key)
        items[key + "-renamed"] = rec
        kind = f"record-renamed:{type(rec).__name__}"
    elif how in (5, 6, 7):
        metrics = [k for k, v in items.items() if isinstance(v, MetricRecord)]
        if metrics:
            m = dict(items[metrics[0]])
            if rng.random() < 0.15:
                m.pop("num-examples", None)
                kind = "num-examples:missing"
            else:
                v = rng.choice(_NUM_EXAMPLES)
                kind = f"num-examples:{v!r}"
                m["num-examples"] = v
            items[metrics[0]] = _record(MetricRecord, m, items[metrics[0]])
        else:
            kind = "num-examples:no-metrics"
    elif how in (8, 9, 10, 11):
        up = items.get(protocol.UPLINK)
        if isinstance(up, ConfigRecord):
            rec = dict(up)
            key = rng.choice([*rec, "replica-version", "replica-digest", "payload", "unknown-key"])
            r = rng.random()
            if r < 0.25 and key in rec:
                del rec[key]
                kind = f"uplink:{key}:dropped"
            elif key == "payload" and isinstance(rec.get("payload"), bytes) and r < 0.6:
                data = rec["payload"]
                data = (
                    serde.seal(_flip_bits(_body(data), rng, rng.choice([1, 4]))) if r < 0.45 else data[: len(data) // 2]
                )
                rec["payload"] = data
                kind = "uplink:payload:corrupted"
            else:
                v = rng.choice(_ODD_VALUES)
                rec[key] = v
                kind = f"uplink:{key}:{type(v).__name__}"
            items[protocol.UPLINK] = _record(ConfigRecord, rec, up)
        else:
            kind = "uplink:absent"
    elif how == 12:
        code = rng.choice([0, 1, int(protocol.ErrorCode.RESYNC), 999])
        return f"error-reply:{code}", Message(Error(code=code, reason="fuzz"), reply_to=request)
    else:
        if others:
            donor = rng.choice(others)
            if donor.has_content():
                items = dict(donor.content.items())
        kind = "content-of-another-node"
    try:
        content = RecordDict(items)
    except Exception:
        return kind + ":unsendable", reply
    return kind, Message(content, reply_to=request)


def _record(cls: Any, values: Mapping[str, Any], fallback: Any) -> Any:
    """``cls(values)``, or ``fallback`` when Flower refuses a value (a client could not send it)."""
    try:
        return cls(dict(values))
    except Exception:
        return fallback


def fuzz_replies(n: int, seed: int, progress: bool = False) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    undo = _task_identity()
    # A round (3 replies decoded, FedAvg, the next downlink) gets 1 s; its memory is not judged
    # (the model is 12.8 kB: below what resident-memory measurement can resolve).
    tally = Tally(sum(4 * t.numel() for t in small_model(seed).values()), floor_bytes=1_000_000)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.CRITICAL)  # one warning per rejected reply otherwise
    # The first half of the rounds under the 3LC downlink (the library's default), the second under
    # the lattice (the reference app's), whose grid judges each update too.
    downlinks = ({"downlink-codec": "3lc"}, {"downlink-codec": "lattice"})
    fed = Federation(seed, downlinks[0])
    ended = 0
    t_start = time.perf_counter()
    try:
        for i in range(n):
            if i == n // 2 and n > 1:
                fed = Federation(seed + i, downlinks[1])
            fed.round += 1
            train = i % 5 != 4
            kind = "?"
            try:
                requests, replies = fed.replies(train)
            except Exception as exc:
                tally.add("setup", "other_exception", 0.0, 0, None, _describe(exc))
                fed = Federation(seed + i, downlinks[2 * i >= n])
                continue
            j = rng.randrange(len(replies))
            kind, replies[j] = _mutate_reply(rng, requests[j], replies[j], replies[:j] + replies[j + 1 :])
            if rng.random() < 0.05:
                replies.append(replies[j])
                kind += "+duplicated"
            kind = ("train:" if train else "evaluate:") + kind
            t0 = time.perf_counter()
            try:
                fed.aggregate(train, replies)
                outcome, detail = "run_continued", ""
            except Exception as exc:
                outcome, detail = "run_ended", _describe(exc) + " | " + traceback.format_exc(limit=-4)
                ended += 1
                fed = Federation(seed + i, downlinks[2 * i >= n])
            tally.add(kind, outcome, time.perf_counter() - t0, 0, None, detail)
            if progress and (i + 1) % 100 == 0:
                print(f"replies: {i + 1}/{n} ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    finally:
        undo()
        flwr_log.setLevel(level)
    out = tally.report()
    rejected = sum(len(t.rejected) for t in fed.strategy.traffic.values())
    out.update(inputs=n, runs_ended=ended, rejected_in_last_federation=rejected, seconds=time.perf_counter() - t_start)
    return out


# --- command line ----------------------------------------------------------------------------------


def run(n: int, replies: int, seed: int, model: str = "lenet", progress: bool = False) -> dict[str, Any]:
    """Both fuzzers; the dict the ``--json`` file holds."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"seed": seed, "n": n, "replies": replies}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # inputs are small: intra-op threads only contend (3LC: 70x slower with 2)
    try:
        out["payloads"] = fuzz_payloads(n, seed, model, progress) if n else None
        out["replies_fuzz"] = fuzz_replies(replies, seed, progress) if replies else None
    finally:
        torch.set_num_threads(threads)
    p, r = out["payloads"] or {}, out["replies_fuzz"] or {}
    out["summary"] = {
        "untyped_exceptions": p.get("outcomes", {}).get("other_exception", 0)
        + r.get("outcomes", {}).get("other_exception", 0),
        "runs_ended": r.get("runs_ended", 0),
        "over_time": p.get("outcomes", {}).get("over_time", 0) + r.get("outcomes", {}).get("over_time", 0),
        "over_memory": p.get("outcomes", {}).get("over_memory", 0),
    }
    out["seconds"] = time.perf_counter() - t0
    try:
        import resource

        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # pragma: no cover - not Unix
        out["peak_rss_mb"] = None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedcomp.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="mutated payloads to decode (default 10000)")
    parser.add_argument("--replies", type=int, default=0, help="rounds with a mutated Flower reply (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet", help="model of the payloads")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--input", type=int, metavar="I", help="decode only payload input I of this seed and model (a repro), print it"
    )
    args = parser.parse_args(argv)
    if args.input is not None:
        if args.input < 0:
            parser.error("--input must be >= 0")
        torch.set_num_threads(1)
        print(json.dumps(replay_input(args.seed, args.model, args.input), indent=1))
        return 0
    if args.n < 0 or args.replies < 0:
        parser.error("--n and --replies must be >= 0")
    out = run(args.n, args.replies, args.seed, args.model, progress=not args.quiet)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    s = out["summary"]
    p = out["payloads"] or {}
    r = out["replies_fuzz"] or {}
    print(f"seed {args.seed}: {out['seconds']:.1f} s, peak RSS {out['peak_rss_mb']:.0f} MB")
    if p:
        print(f"payloads ({p['inputs']}, model {p['model']} {p['model_bytes']} B): {p['outcomes']}")
    if r:
        print(f"replies ({r['inputs']}): {r['outcomes']}")
    print(
        f"untyped exceptions {s['untyped_exceptions']}, runs ended {s['runs_ended']}, "
        f"over time {s['over_time']}, over memory {s['over_memory']}"
    )
    return 1 if s["untyped_exceptions"] or s["runs_ended"] else 0


if __name__ == "__main__":
    sys.exit(main())
