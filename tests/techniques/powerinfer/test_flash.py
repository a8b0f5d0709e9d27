"""The neuron-bundled flash file (NumPy only): exact round trips (float32, float16, relu),
the aligned layout, neuron reads (any order, consecutive runs coalesced into one request),
header / size / digest checks, the O_DIRECT fallback, and the single I/O thread under
concurrent submitters and on close."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from dlm_jax import CheckpointError, ConfigError
from dlm_jax.techniques.powerinfer import flash, flash_io
from dlm_jax.techniques.powerinfer.flash import (
    FlashFile,
    FlashHeader,
    drop_page_cache,
    read_all,
    write_flash,
)
from dlm_jax.techniques.powerinfer.flash_io import FlashReader, ReaderThread

D = 16
NEURONS = (40, 24)  # layers may differ in width


def _layers(kind: str = "reglu", neurons: tuple[int, ...] = NEURONS, d: int = D, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for f in neurons:
        layer = {"up": rng.standard_normal((f, d), np.float32), "down": rng.standard_normal((d, f), np.float32)}
        if kind == "reglu":
            layer["gate"] = rng.standard_normal((f, d), np.float32)
        out.append(layer)
    return out


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, list[dict]]:
    layers = _layers()
    path = tmp_path / "ffn.flash"
    write_flash(path, layers, alignment=512)
    return path, layers


def _runs(ids: list[int]) -> int:
    s = sorted(ids)
    return sum(1 for i, x in enumerate(s) if i == 0 or x != s[i - 1] + 1)


def _expected(layer: dict, ids: list[int]) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    gate = layer["gate"][ids] if "gate" in layer else None
    return gate, layer["up"][ids], layer["down"][:, ids]


def _assert_bundles(got: flash_io.NeuronBundles, layer: dict, ids: list[int]) -> None:
    gate, up, down = _expected(layer, ids)
    assert got.neurons.dtype == np.int64 and got.neurons.tolist() == list(ids)
    assert got.up.dtype == np.float32 and got.down.dtype == np.float32
    np.testing.assert_array_equal(got.up, up)
    np.testing.assert_array_equal(got.down, down)
    if gate is None:
        assert got.gate is None
    else:
        np.testing.assert_array_equal(got.gate, gate)


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["reglu", "relu"])
def test_round_trip_is_bitwise(tmp_path: Path, dtype: str, kind: str) -> None:
    layers = _layers(kind)
    header = write_flash(tmp_path / "ffn.flash", layers, kind=kind, dtype=dtype, alignment=512)
    assert header.parts == (("gate", "up", "down") if kind == "reglu" else ("up", "down"))
    back = read_all(FlashFile.open(tmp_path / "ffn.flash", verify=True))
    assert len(back) == len(layers)
    for want, got in zip(layers, back, strict=True):
        assert set(got) == set(want)
        for name, array in want.items():
            assert got[name].dtype == np.dtype(dtype) and got[name].shape == array.shape
            assert got[name].tobytes() == array.astype(dtype).tobytes()


def test_reader_converts_float16_to_float32(tmp_path: Path) -> None:
    layers = _layers()
    write_flash(tmp_path / "ffn.flash", layers, dtype="float16", alignment=512)
    with FlashReader(FlashFile.open(tmp_path / "ffn.flash")) as reader:
        got = reader.read(1, [7, 2, 3])
    assert got.gate.dtype == np.float32
    np.testing.assert_array_equal(got.gate, layers[1]["gate"][[7, 2, 3]].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got.down, layers[1]["down"][:, [7, 2, 3]].astype(np.float16).astype(np.float32))


def test_header_dict_round_trip_and_bundle_offsets(small: tuple[Path, list[dict]]) -> None:
    header = FlashFile.open(small[0]).header
    assert FlashHeader.from_dict(header.to_dict()) == header
    assert header.bundle_offset(1, 3) == header.layer_offsets[1] + 3 * header.stride
    with pytest.raises(ConfigError, match="out of range"):
        header.bundle_offset(0, NEURONS[0])
    with pytest.raises(ConfigError, match="layer=2"):
        header.bundle_offset(2, 0)


# ----------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("alignment", [512, 4096])
def test_layout_is_aligned_and_sized(tmp_path: Path, alignment: int) -> None:
    layers = _layers()
    path = tmp_path / "ffn.flash"
    header = write_flash(path, layers, alignment=alignment)
    raw = path.read_bytes()
    assert raw[:8] == b"DLMFLASH" and int.from_bytes(raw[8:12], "little") == 1
    assert header.data_offset % 4096 == 0 and header.data_offset % alignment == 0
    assert header.bundle_bytes == 3 * D * 4 and header.stride == -(-header.bundle_bytes // alignment) * alignment
    assert len(raw) == header.nbytes == header.data_offset + sum(NEURONS) * header.stride
    assert FlashFile.open(path).nbytes == len(raw)
    for layer, f in enumerate(NEURONS):
        for i in range(f):
            at = header.bundle_offset(layer, i)
            assert at % alignment == 0
            bundle = np.frombuffer(raw[at:at + header.bundle_bytes], "<f4")
            want = np.concatenate([layers[layer]["gate"][i], layers[layer]["up"][i], layers[layer]["down"][:, i]])
            np.testing.assert_array_equal(bundle, want)
            assert not any(raw[at + header.bundle_bytes:at + header.stride])  # zero padding


# ---------------------------------------------------------------------------------- reading


def test_reads_match_slices_and_coalesce_runs(small: tuple[Path, list[dict]]) -> None:
    path, layers = small
    rng = np.random.default_rng(1)
    cases = [[0], [3, 4, 5, 6], [9, 1, 2, 3, 30], [39, 0, 38, 1], list(range(NEURONS[0]))[::-1]]
    cases += [rng.choice(NEURONS[0], size=int(rng.integers(1, 20)), replace=False).tolist() for _ in range(15)]
    total_requests = total_bytes = 0
    with FlashReader(FlashFile.open(path)) as reader:
        for ids in cases:
            got = reader.read(0, ids)
            _assert_bundles(got, layers[0], ids)
            assert got.requests == _runs(ids)
            assert got.bytes_read == len(ids) * reader.header.stride
            total_requests += got.requests
            total_bytes += got.bytes_read
        got = reader.read(1, np.array([23, 0, 11], np.int32))
        _assert_bundles(got, layers[1], [23, 0, 11])
        assert (reader.requests, reader.bytes_read) == (total_requests + 3, total_bytes + 3 * reader.header.stride)
        empty = reader.read(1, [])
        assert empty.up.shape == (0, D) and empty.down.shape == (D, 0) and empty.requests == 0


def test_relu_reads_have_no_gate(tmp_path: Path) -> None:
    layers = _layers("relu")
    write_flash(tmp_path / "ffn.flash", layers, kind="relu", alignment=512)
    with FlashReader(tmp_path / "ffn.flash") as reader:
        _assert_bundles(reader.read(1, [5, 6, 0]), layers[1], [5, 6, 0])


@pytest.mark.parametrize(("layer", "neurons", "match"), [
    (0, [1, 2, 1], "neuron 1 is asked for twice"),
    (0, [0, 40], r"neuron 40 is out of range \[0, 40\)"),
    (1, [-1], "neuron -1 is out of range"),
    (2, [0], "layer=2 is out of range"),
    (0, [0.5], "integers"),
    (0, [[0, 1]], "1-D"),
])
def test_bad_reads_are_config_errors(small: tuple[Path, list[dict]], layer: int, neurons: list, match: str) -> None:
    with FlashReader(small[0]) as reader, pytest.raises(ConfigError, match=match):
        reader.read(layer, neurons)


def test_read_after_close_is_an_error(small: tuple[Path, list[dict]]) -> None:
    reader = FlashReader(small[0])
    reader.close()
    reader.close()
    with pytest.raises(ConfigError, match="closed"):
        reader.read(0, [0])


# ------------------------------------------------------------------------ damaged files


def test_truncated_file_names_both_sizes(small: tuple[Path, list[dict]]) -> None:
    path = small[0]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"ffn.flash: truncated .*{size - 100} bytes.*{size}"):
        FlashFile.open(path)


def test_tampered_layer_fails_verify(small: tuple[Path, list[dict]]) -> None:
    path = small[0]
    header = FlashFile.open(path).header
    at = header.bundle_offset(1, 5) + 4
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    FlashFile.open(path)  # the sizes still agree: only verify sees it
    with pytest.raises(CheckpointError, match=r"ffn.flash: layer 1 does not match its sha256"):
        FlashFile.open(path, verify=True)


@pytest.mark.parametrize(("offset", "value", "match"), [
    (0, b"NOTFLASH", "magic"),
    (8, (2).to_bytes(4, "little"), "version 2"),
    (16, b"[", "header JSON"),
])
def test_bad_header_is_not_a_flash_file(small: tuple[Path, list[dict]], offset: int, value: bytes, match: str) -> None:
    path = small[0]
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(value)] = value
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"ffn.flash: not a dlm-jax flash file .*{match}"):
        FlashFile.open(path)


def test_inconsistent_header_fields(small: tuple[Path, list[dict]]) -> None:
    data = FlashFile.open(small[0]).header.to_dict()
    with pytest.raises(CheckpointError, match=r"not a dlm-jax flash file .*stride"):
        FlashHeader.from_dict({**data, "stride": data["stride"] + 512})
    with pytest.raises(CheckpointError, match="missing field 'sha256'"):
        FlashHeader.from_dict({k: v for k, v in data.items() if k != "sha256"})


def test_missing_and_tiny_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read"):
        FlashFile.open(tmp_path / "absent.flash")
    (tmp_path / "tiny.flash").write_bytes(b"DLM")
    with pytest.raises(CheckpointError, match="not a dlm-jax flash file"):
        FlashFile.open(tmp_path / "tiny.flash")


# ----------------------------------------------------------------------------------- writing


@pytest.mark.parametrize(("layers", "kwargs", "match"), [
    ([{"up": np.zeros((4, 8)), "down": np.zeros((8, 5)), "gate": np.zeros((4, 8))}], {}, r"layer 0 .*down \(8, 5\)"),
    ([{"up": np.zeros((4, 8)), "down": np.zeros((8, 4)), "gate": np.zeros((3, 8))}], {}, r"layer 0 has gate \(3, 8\)"),
    ([{"up": np.zeros((4, 8)), "down": np.zeros((8, 4))}], {}, "needs exactly"),
    ([{"up": np.zeros((4, 8)), "down": np.zeros((8, 4)), "gate": np.zeros((4, 8))}], {"kind": "relu"}, "needs exactly"),
    (_layers(neurons=(4,), d=8) + _layers(neurons=(4,), d=6), {}, r"d_model \[6, 8\]"),
    ([{"up": np.zeros(4), "down": np.zeros((8, 4)), "gate": np.zeros((4, 8))}], {}, "layer 0 'up'"),
    ([], {}, "non-empty"),
    (_layers(neurons=(4,)), {"alignment": 1000}, "power of two"),
    (_layers(neurons=(4,)), {"alignment": 256}, "power of two"),
    (_layers(neurons=(4,)), {"dtype": "bfloat16"}, "dtype"),
    (_layers(neurons=(4,)), {"kind": "swiglu"}, "kind"),
])
def test_bad_writes_are_config_errors(tmp_path: Path, layers: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        write_flash(tmp_path / "ffn.flash", layers, **kwargs)
    assert not list(tmp_path.iterdir())


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing(*args: object) -> str:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    real = flash._write_layer
    monkeypatch.setattr(flash, "_write_layer", failing)
    with pytest.raises(CheckpointError, match=r"ffn.flash: cannot write the flash file .*No space"):
        write_flash(tmp_path / "ffn.flash", _layers(), alignment=512)
    assert not list(tmp_path.iterdir())


def test_rewrite_replaces_the_file(small: tuple[Path, list[dict]]) -> None:
    path = small[0]
    layers = _layers(neurons=(8,), seed=5)
    write_flash(path, layers, alignment=512)
    assert FlashFile.open(path).header.neurons == (8,)
    np.testing.assert_array_equal(read_all(path)[0]["up"], layers[0]["up"])
    assert [p.name for p in path.parent.iterdir()] == ["ffn.flash"]


# -------------------------------------------------------------------------------- O_DIRECT


def test_open_einval_falls_back_with_one_note(small: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    path, layers = small
    real_open = os.open

    def no_direct(file: object, flags: int, *args: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    notes: list[str] = []
    with FlashReader(FlashFile.open(path), on_note=notes.append) as reader:
        assert reader.direct is False
        for i in range(10):
            _assert_bundles(reader.read(i % 2, [i, i + 1]), layers[i % 2], [i, i + 1])
    assert notes == [reader.note]
    assert reader.note.startswith(f"{path}: O_DIRECT is not supported on this filesystem (")
    assert reader.note.endswith("; using buffered reads")


def test_first_read_einval_falls_back_with_one_note(small: tuple[Path, list[dict]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that takes O_DIRECT at open but refuses the read (the fd is opened
    buffered underneath, and marked, so the test runs the same on any file system)."""
    path, layers = small
    real_open, real_preadv = os.open, os.preadv
    marked: set[int] = set()
    direct = getattr(os, "O_DIRECT", 0)

    def fake_open(file: object, flags: int, *args: object) -> int:
        fd = real_open(file, flags & ~direct, *args)
        if flags & direct:
            marked.add(fd)
        return fd

    def fake_preadv(fd: int, buffers: list, offset: int) -> int:
        if fd in marked:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    notes: list[str] = []
    with FlashReader(path, on_note=notes.append) as reader:
        assert reader.direct is False
        for ids in ([3, 1], [0, 1, 2], [39]):
            _assert_bundles(reader.read(0, ids), layers[0], ids)
    assert len(notes) == 1 and "O_DIRECT is not supported" in notes[0]
    assert reader.requests == 4  # the probe is not counted


def test_real_direct_read_or_fallback_note(tmp_path: Path) -> None:
    """Default 4 KiB alignment. Where the file system takes O_DIRECT (ext4, xfs) reads bypass
    the page cache; where it does not (tmpfs), the reader says so once."""
    layers = _layers(neurons=(12,))
    path = tmp_path / "ffn.flash"
    write_flash(path, layers)
    assert drop_page_cache(path) is hasattr(os, "posix_fadvise")
    notes: list[str] = []
    with FlashReader(path, on_note=notes.append) as reader:
        _assert_bundles(reader.read(0, [11, 4, 5, 6, 0]), layers[0], [11, 4, 5, 6, 0])
        if reader.direct:
            assert notes == [] and reader.note is None
        else:
            assert notes == [reader.note] and "O_DIRECT is not supported on this filesystem" in reader.note


def test_buffered_reader_never_notes(small: tuple[Path, list[dict]]) -> None:
    notes: list[str] = []
    with FlashReader(small[0], direct=False, on_note=notes.append) as reader:
        _assert_bundles(reader.read(0, [2, 1]), small[1][0], [2, 1])
        assert reader.direct is False and reader.note is None and notes == []


# ------------------------------------------------------------------------------- I/O thread


def test_reader_thread_serves_concurrent_submitters(small: tuple[Path, list[dict]]) -> None:
    path, layers = small
    results: list[tuple[int, list[int], object]] = []
    lock = threading.Lock()
    with FlashReader(path) as reader, ReaderThread(reader) as io:

        def submitter(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                layer = int(rng.integers(2))
                ids = rng.choice(NEURONS[layer], size=int(rng.integers(1, 9)), replace=False).tolist()
                future = io.submit(layer, ids)
                with lock:
                    results.append((layer, ids, future))

        threads = [threading.Thread(target=submitter, args=(seed,)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for layer, ids, future in results:
            _assert_bundles(future.result(timeout=10), layers[layer], ids)
    assert len(results) == 160
    assert reader.requests == sum(_runs(ids) for _, ids, _ in results)


def test_reader_is_shared_between_threads(small: tuple[Path, list[dict]]) -> None:
    """Positioned reads need no shared offset: threads read through one reader at once."""
    path, layers = small
    errors: list[BaseException] = []
    with FlashReader(path) as reader:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(25):
                    ids = rng.choice(NEURONS[0], size=6, replace=False).tolist()
                    _assert_bundles(reader.read(0, ids), layers[0], ids)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert reader.bytes_read == 4 * 25 * 6 * reader.header.stride


def test_reader_thread_puts_errors_on_the_future(small: tuple[Path, list[dict]]) -> None:
    with FlashReader(small[0]) as reader, ReaderThread(reader) as io:
        bad = io.submit(0, [99])
        good = io.submit(0, [1])
        assert isinstance(bad.exception(timeout=10), ConfigError)
        _assert_bundles(good.result(timeout=10), small[1][0], [1])
    with pytest.raises(ConfigError, match="closed"):
        io.submit(0, [1])


class _BlockingReader:
    """Its first read waits for `release`: the rest queue up behind it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.reads = 0

    def read(self, layer: int, neurons: object) -> int:
        self.reads += 1
        self.started.set()
        assert self.release.wait(10)
        return layer


@pytest.mark.parametrize("cancel", [True, False])
def test_reader_thread_close_leaves_no_future_pending(cancel: bool) -> None:
    reader = _BlockingReader()
    io = ReaderThread(reader)
    futures = [io.submit(i, [0]) for i in range(12)]
    assert reader.started.wait(10)
    timer = threading.Timer(0.05, reader.release.set)
    timer.start()
    io.close(cancel=cancel)
    timer.join()
    assert all(f.done() for f in futures)
    assert futures[0].result() == 0
    if cancel:
        assert reader.reads == 1 and all(f.cancelled() for f in futures[1:])
    else:
        assert reader.reads == 12 and [f.result() for f in futures] == list(range(12))
    io.close()  # idempotent


def test_a_planned_order_lays_neurons_out_and_reads_them_back(tmp_path: Path) -> None:
    layers = _layers()
    rng = np.random.default_rng(3)
    order = [rng.permutation(f) for f in NEURONS]
    path = tmp_path / "ordered.flash"
    header = write_flash(path, layers, alignment=512, order=order)
    assert FlashFile.open(path, verify=True).header == header
    for got, want in zip(read_all(path), layers):  # neuron order back, whatever the layout
        for part in want:
            np.testing.assert_array_equal(got[part], want[part])
    # the bundle at position p is neuron order[p]: the planner's neighbours are flash neighbours
    assert header.bundle_offset(0, int(order[0][5])) == header.layer_offsets[0] + 5 * header.stride
    with FlashReader(path, direct=False) as reader:
        ids = [int(n) for n in order[1][3:11]]  # eight consecutive positions: one request
        got = reader.read(1, ids[::-1])
        gate, up, down = _expected(layers[1], ids[::-1])
        np.testing.assert_array_equal(got.up, up)
        np.testing.assert_array_equal(got.gate, gate)
        np.testing.assert_array_equal(got.down, down)
        assert got.requests == 1


def test_an_order_that_is_not_a_permutation_is_refused(tmp_path: Path) -> None:
    bad = [np.arange(NEURONS[0]), np.zeros(NEURONS[1], np.int64)]
    with pytest.raises(ConfigError, match="order of layer 1 is not a permutation of its 24 neurons"):
        write_flash(tmp_path / "x.flash", _layers(), order=bad)
    assert not (tmp_path / "x.flash").exists()


def test_background_reads_wait_for_demand_reads(small: tuple[Path, list[dict]]) -> None:
    path, layers = small
    served: list[str] = []
    gate = threading.Event()

    class Slow:
        def read(self, layer, ids):
            gate.wait(5)
            served.append("bg" if len(ids) == 2 else "demand")
            return len(ids)

    thread = ReaderThread(Slow())
    first = thread.submit(0, [0])  # in flight while the rest queue up
    later = [thread.submit(0, [1, 2], background=True), thread.submit(0, [3, 4], background=True)]
    demand = thread.submit(0, [5])
    gate.set()
    assert [f.result() for f in (first, demand, *later)] == [1, 1, 2, 2]
    assert served == ["demand", "demand", "bg", "bg"]  # the late demand read overtook the queued read-ahead
    thread.close()
