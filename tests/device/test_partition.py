"""Hash partitioning on the device (dissoc.device.partition) and the shared row hash (dissoc.hashing).

Every device test runs on the fake device backend, and again on CuPy where the ``gpu`` marker finds a CUDA
device (the same test code: the partitioner computes with the backend's array module). The reference is the
host: the Spark exchange's ``hash_partition`` for destinations, ``pyarrow``'s ``filter`` for the buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
from helpers.hash_reference import column_hash as _column_hash
from helpers.hash_reference import mix as _mix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dissoc import hashing
from dissoc.device import (
    DeviceBatch,
    DeviceInterfaceError,
    can_partition_on_device,
    concat_device_batches,
    device_destinations,
    partition_device_batch,
)
from dissoc.errors import DissocError
from dissoc.memory.cuda import DeviceBackend, FakeDeviceArray, FakeDeviceBackend, use_backend
from dissoc.spark._exchange import hash_partition

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class _Counts:
    """Counts a backend's host transfers (mixed into the backend under test)."""

    uploads = 0
    downloads = 0
    downloaded = 0

    def upload(self, data: Any) -> Any:
        self.uploads += 1
        return super().upload(data)  # type: ignore[misc]

    def download(self, array: Any, out: Any = None) -> Any:
        self.downloads += 1
        self.downloaded += int(array.nbytes)
        return super().download(array, out)  # type: ignore[misc]


def _make_backend(kind: str) -> Any:
    if kind == "fake":
        return type("CountingFake", (_Counts, FakeDeviceBackend), {})()
    from dissoc.memory.cuda import CupyBackend

    return type("CountingCupy", (_Counts, CupyBackend), {})()


@pytest.fixture(scope="module", params=["fake", pytest.param("cupy", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    dev = _make_backend(request.param)
    with use_backend(dev):
        yield dev


def _host(backend: DeviceBackend, array: Any) -> npt.NDArray[Any]:
    """An array of the backend's array module, copied to a numpy array (as the test's reference)."""
    xp = backend.array_module
    return np.asarray(xp.asnumpy(array) if hasattr(xp, "asnumpy") else array)


# --------------------------------------------------------------------------------------------------
# Batches


F64_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1.5, -1.5, 1e-310]


def _floats(rng: np.random.Generator, rows: int, dtype: Any) -> npt.NDArray[Any]:
    values = rng.normal(0, 1e3, rows).astype(dtype)
    special = rng.random(rows) < 0.3
    values[special] = np.asarray(rng.choice(F64_SPECIAL, rows), dtype)[special]
    return values


def _mask(rng: np.random.Generator, rows: int) -> npt.NDArray[np.bool_] | None:
    return None if rng.random() < 0.3 else rng.random(rows) < 0.25


def _random_batch(seed: int, rows: int) -> pa.RecordBatch:
    """Every gatherable kind of column, each with or without nulls; keys repeat (a narrow range)."""
    rng = np.random.default_rng(seed)

    def ints(dtype: Any, lo: int, hi: int) -> npt.NDArray[Any]:
        return rng.integers(lo, hi, rows, dtype=dtype, endpoint=True)

    def arr(values: Any, ty: pa.DataType | None = None) -> pa.Array:
        return pa.array(values, type=ty, mask=_mask(rng, rows))

    dec = [Decimal(int(v)).scaleb(-2) for v in ints(np.int64, -(10**6), 10**6)]
    fsb = [bytes(rng.integers(0, 255, 3, dtype=np.uint8)) for _ in range(rows)]
    uuids = [bytes(rng.integers(0, 255, 16, dtype=np.uint8)) for _ in range(rows)]
    cols = {
        "i8": arr(ints(np.int8, -128, 127)),
        "i16": arr(ints(np.int16, -5, 5)),
        "i32": arr(ints(np.int32, -3, 3)),
        "i64": arr(ints(np.int64, -(2**63), 2**63 - 1)),
        "u8": arr(ints(np.uint8, 0, 255)),
        "u16": arr(ints(np.uint16, 0, 4)),
        "u32": arr(ints(np.uint32, 0, 2**32 - 1)),
        "u64": arr(ints(np.uint64, 2**64 - 8, 2**64 - 1)),
        "f16": arr(_floats(rng, rows, np.float16)),
        "f32": arr(_floats(rng, rows, np.float32)),
        "f64": arr(_floats(rng, rows, np.float64)),
        "b": arr(rng.random(rows) < 0.5),
        "ts": arr(ints(np.int64, -(10**12), 10**12), pa.timestamp("us", tz="UTC")),
        "date64": arr(ints(np.int64, 0, 3) * 86_400_000, pa.date64()),
        "time64": arr(ints(np.int64, 0, 10**9), pa.time64("ns")),
        "dur": arr(ints(np.int64, -5, 5), pa.duration("ms")),
        "date32": arr(ints(np.int32, -3, 3), pa.date32()),
        "time32": arr(ints(np.int32, 0, 86_399), pa.time32("s")),
        "dec": pa.array(dec, pa.decimal128(12, 2), mask=_mask(rng, rows)),
        "fsb": pa.array(fsb, pa.binary(3), mask=_mask(rng, rows)),
        "null": pa.nulls(rows),
        "uuid": pa.ExtensionArray.from_storage(  # an extension type, gathered as its storage
            pa.uuid(), pa.array(uuids, pa.binary(16), mask=_mask(rng, rows))
        ),
    }
    return pa.record_batch(cols)


#: Key columns the host's hash_partition hashes (it cannot cast date32 and time32 to int64).
HOST_KEYS = ["i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f16", "f32", "f64", "b", "ts"]
HOST_KEYS += ["date64", "time64", "dur"]


def _explicit_batch() -> pa.RecordBatch:
    return pa.record_batch(
        {
            "id": pa.array([1, None, 3, -4, 5, 1, 3, None, 2**40, -(2**40)], pa.int64()),
            "f": pa.array([0.0, -0.0, None, 1.5, math.nan, -0.0, 0.0, math.inf, -1.5, None], pa.float64()),
            "flag": pa.array([True, None, False, True, True, False, None, True, False, True]),
            "ts": pa.array([0, 1, None, 3, 4, 0, 1, 2, 3, 4], pa.timestamp("ns")),
            "x": pa.array(np.arange(10, dtype=np.float32)),
        }
    )


def _bits_of(column: pa.Array) -> tuple[list[bool], Any]:
    """A column's validity and its valid values, floats as their bits (so NaN equals NaN, -0.0 not 0.0)."""
    valid = column.is_valid().to_pylist()
    if pa.types.is_temporal(column.type):
        column = column.view(pa.int64() if column.type.bit_width == 64 else pa.int32())
    if pa.types.is_floating(column.type) and len(column):
        width = column.type.bit_width // 8
        raw = np.frombuffer(column.buffers()[1], f"<u{width}", count=column.offset + len(column))
        return valid, raw[column.offset :][np.asarray(valid, bool)].tolist()
    return valid, [v for v, ok in zip(column.to_pylist(), valid, strict=True) if ok]


def assert_same_rows(got: pa.RecordBatch, expected: pa.RecordBatch, what: str) -> None:
    got.validate(full=True)
    assert got.schema.equals(expected.schema), what
    assert got.num_rows == expected.num_rows, f"{what}: {got.num_rows} rows, expected {expected.num_rows}"
    for name in expected.schema.names:
        assert _bits_of(got.column(name)) == _bits_of(expected.column(name)), f"{what}: column {name!r}"


def _check_partition(
    backend: Any,
    batch: pa.RecordBatch,
    parts: Sequence[DeviceBatch],
    dest: npt.NDArray[np.int64],
    n: int,
) -> None:
    assert len(parts) == n
    for j, part in enumerate(parts):
        assert part.backend is backend
        assert len(part.messages) == 1 and backend.is_device_array(part.messages[0].body)
        assert part.schema_metadata == parts[0].schema_metadata
        assert_same_rows(part.to_arrow(), batch.filter(pa.array(dest == j)), f"bucket {j} of {n}")


# --------------------------------------------------------------------------------------------------
# dissoc.hashing against the exchange's own hash (the host reference)


def _host_columns() -> dict[str, pa.Array]:
    batch = _random_batch(7, 200)
    cols = {name: batch.column(name) for name in HOST_KEYS}
    cols["str"] = pa.array(["a", None, "bb", "a", ""] * 4)
    cols["large_str"] = pa.array(["a", None, "bb", "a", ""] * 4, pa.large_string())
    cols["bin"] = pa.array([b"a", None, b"\x00", b"a"] * 5)
    cols["dec"] = batch.column("dec")
    cols["fsb"] = batch.column("fsb")
    cols["list"] = pa.array([[1, 2], None, [], [1, 2], [3]] * 4)
    cols["dict"] = pa.array(["x", "y", None, "x"] * 5).dictionary_encode()
    cols["dict_int"] = pa.array([5, 6, None, 5] * 5).dictionary_encode()
    cols["null"] = pa.nulls(7)
    cols["sliced_i32"] = batch.column("i32").slice(3, 50)
    cols["sliced_b"] = batch.column("b").slice(5, 61)
    cols["sliced_f32"] = batch.column("f32").slice(11, 40)
    f64_nan = np.array([0x7FF0000000000001, 0xFFF8000000000000, 0x8000000000000000], np.uint64)
    cols["nan_payload_f64"] = pa.array(f64_nan.view(np.float64))
    cols["nan_payload_f32"] = pa.array(
        np.array([0x7F800001, 0xFFC00001, 0x80000000], np.uint32).view(np.float32)
    )
    cols["nan_payload_f16"] = pa.array(np.array([0x7C01, 0xFE01, 0x8000, 0x7E00], np.uint16).view(np.float16))
    return cols


@pytest.mark.parametrize("name", sorted(_host_columns()))
def test_column_hash_equals_the_exchange(name: str) -> None:
    column = _host_columns()[name]
    with np.errstate(invalid="ignore"):  # the reference's x + 0.0 on a signalling NaN
        expected = _column_hash(column)
    got = hashing.column_hash(column)
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("ty", [pa.date32(), pa.time32("ms")])
def test_column_hash_of_32_bit_temporal_is_its_value_as_int64(ty: pa.DataType) -> None:
    # The exchange's hash cannot cast these to int64 (pyarrow refuses); dissoc.hashing hashes their values.
    column = pa.array([0, -1 if ty == pa.date32() else 1, None, 7], ty)
    as_int64 = column.view(pa.int32()).cast(pa.int64())
    np.testing.assert_array_equal(hashing.column_hash(column), _column_hash(as_int64))


def test_mix_and_combine_equal_the_exchange() -> None:
    rng = np.random.default_rng(1)
    h = rng.integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True)
    c = rng.integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True)
    np.testing.assert_array_equal(hashing.mix(h, np), _mix(h))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(hashing.combine(h, c, np), _mix(h * np.uint64(31) + c))
    assert hashing.mix(np.zeros(1, np.uint64))[0] == 0
    nulls = hashing.with_nulls(c, np.zeros(1000, bool))
    assert (nulls == hashing.NULL_HASH).all() and hashing.NULL_HASH == 0x9E3779B97F4A7C15


@SETTINGS
@given(
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=40),
    st.lists(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)), max_size=40),
    st.integers(1, 50),
)
def test_hash_partition_from_dissoc_hashing(
    ints: list[int | None], floats: list[float | None], n: int
) -> None:
    rows = min(len(ints), len(floats))
    batch = pa.record_batch(
        {"i": pa.array(ints[:rows], pa.int64()), "f": pa.array(floats[:rows], pa.float64())}
    )
    hashes = [hashing.column_hash(batch.column(k)) for k in ("i", "f")]
    got = hashing.destinations(hashing.row_hash(hashes, rows), n)
    np.testing.assert_array_equal(got, hash_partition(batch, ["i", "f"], n))


def test_value_hash_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="value_hash"):
        hashing.value_hash(np.array(["a"]))


# --------------------------------------------------------------------------------------------------
# The backends' array module


def test_backend_array_module_views_without_copy(backend: Any) -> None:
    xp = backend.array_module
    dev = backend.upload(np.arange(16, dtype=np.uint8))
    arr = backend.as_xp(dev)
    assert isinstance(arr, xp.ndarray) and arr.dtype == np.uint8 and arr.shape == (16,)
    arr[3] = 200  # the same memory: the write shows through the device array
    assert backend.download(dev)[3] == 200
    back = backend.from_xp(arr[4:8])
    assert backend.is_device_array(back)
    backend.as_xp(back)[0] = 99
    assert backend.download(dev)[4] == 99
    with pytest.raises(TypeError):
        backend.as_xp(np.zeros(2, np.uint8) if xp is not np else object())
    with pytest.raises(TypeError):
        backend.from_xp(object())


def test_fake_backend_module_is_numpy() -> None:
    fake = FakeDeviceBackend()
    assert fake.array_module is np
    host = np.zeros(4, np.uint8)
    dev = fake.from_xp(host)
    assert isinstance(dev, FakeDeviceArray) and dev.host is host and fake.as_xp(dev) is host


# --------------------------------------------------------------------------------------------------
# Destinations on the device


@pytest.mark.parametrize("key", ["id", "f", "flag", "ts", "x", ["id", "f"], ["flag", "ts", "id", "x"]])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_device_destinations_equal_hash_partition(backend: Any, key: str | list[str], n: int) -> None:
    batch = _explicit_batch()
    db = DeviceBatch.from_arrow(batch)
    got = device_destinations(db, key, n)
    assert isinstance(got, backend.array_module.ndarray) and got.dtype == np.int64
    np.testing.assert_array_equal(_host(backend, got), hash_partition(batch, key, n))


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 70), st.integers(1, 9), st.data())
def test_device_destinations_equal_hash_partition_random(
    backend: Any, seed: int, rows: int, n: int, data: st.DataObject
) -> None:
    batch = _random_batch(seed, rows)
    keys = data.draw(st.lists(st.sampled_from(HOST_KEYS), min_size=1, max_size=3), label="keys")
    db = DeviceBatch.from_arrow(batch)
    got = _host(backend, device_destinations(db, keys, n))
    np.testing.assert_array_equal(got, hash_partition(batch, keys, n))


@pytest.mark.parametrize("key", ["date32", "time32"])
def test_device_destinations_of_32_bit_temporal_match_dissoc_hashing(backend: Any, key: str) -> None:
    batch = _random_batch(3, 40)
    got = _host(backend, device_destinations(DeviceBatch.from_arrow(batch), key, 5))
    expected = hashing.destinations(hashing.row_hash([hashing.column_hash(batch.column(key))], 40), 5)
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------------------------------
# Partitioning


@pytest.mark.parametrize("n", [1, 2, 5])
def test_partition_by_key_round_trips(backend: Any, n: int) -> None:
    batch = _explicit_batch()
    parts = partition_device_batch(DeviceBatch.from_arrow(batch), "id", n)
    _check_partition(backend, batch, parts, hash_partition(batch, "id", n), n)


def test_partition_with_one_task_keeps_the_batch(backend: Any) -> None:
    batch = _random_batch(11, 50)
    (part,) = partition_device_batch(DeviceBatch.from_arrow(batch), ["i32", "f64"], 1)
    assert_same_rows(part.to_arrow(), batch, "n=1")


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 70), st.integers(1, 9), st.booleans())
def test_partition_round_trips_random(backend: Any, seed: int, rows: int, n: int, by_key: bool) -> None:
    batch = _random_batch(seed, rows)
    db = DeviceBatch.from_arrow(batch)
    if by_key:
        dest = hash_partition(batch, ["i16", "b"], n)
        parts = partition_device_batch(db, ["i16", "b"], n)
    else:
        dest = np.random.default_rng(seed).integers(0, n, rows)
        parts = partition_device_batch(db, None, n, destinations=backend.array_module.asarray(dest))
    _check_partition(backend, batch, parts, dest, n)


def test_partition_of_a_sliced_batch(backend: Any) -> None:
    full = _random_batch(5, 120)
    batch = full.slice(13, 77)  # bitmaps and values start mid-buffer in the source
    parts = partition_device_batch(DeviceBatch.from_arrow(batch), "u16", 4)
    _check_partition(backend, batch, parts, hash_partition(batch, "u16", 4), 4)


def test_destinations_from_the_host_or_as_device_arrays(backend: Any) -> None:
    batch = _explicit_batch()
    db = DeviceBatch.from_arrow(batch)
    dest = np.array([2, 0, 1, 2, 2, 0, 0, 1, 2, 0])
    for given_as in (dest.tolist(), dest, backend.from_xp(backend.array_module.asarray(dest))):
        parts = partition_device_batch(db, None, 3, destinations=given_as)
        _check_partition(backend, batch, parts, dest, 3)


def test_zero_rows(backend: Any) -> None:
    batch = _random_batch(2, 0)
    db = DeviceBatch.from_arrow(batch)
    assert _host(backend, device_destinations(db, ["i32", "f64", "b"], 4)).shape == (0,)
    parts = partition_device_batch(db, "i32", 4)
    assert [p.num_rows for p in parts] == [0, 0, 0, 0]
    for part in parts:
        assert_same_rows(part.to_arrow(), batch, "zero rows")
    none = partition_device_batch(db, None, 2, destinations=np.zeros(0, np.int64))
    assert [p.num_rows for p in none] == [0, 0]


def test_empty_buckets_are_zero_row_batches(backend: Any) -> None:
    batch = _explicit_batch()
    dest = np.full(batch.num_rows, 3)
    parts = partition_device_batch(DeviceBatch.from_arrow(batch), None, 5, destinations=dest)
    assert [p.num_rows for p in parts] == [0, 0, 0, 10, 0]
    _check_partition(backend, batch, parts, dest, 5)


def test_partition_copies_no_data_to_or_from_the_host(backend: Any) -> None:
    batch = _random_batch(9, 500)
    db = DeviceBatch.from_arrow(batch)
    before = (backend.uploads, backend.downloads, backend.downloaded)
    parts = partition_device_batch(db, ["i64", "f32"], 6)
    after = (backend.uploads, backend.downloads, backend.downloaded)
    # One download: the numbers of rows and nulls per destination (int64 each, and two spare bins).
    nullable = sum(1 for c in batch.columns if c.null_count and c.type != pa.null())
    assert after[0] - before[0] == 0
    assert after[1] - before[1] == 1
    assert after[2] - before[2] == (1 + nullable) * (6 + 2) * 8
    assert sum(p.num_rows for p in parts) == 500


# --------------------------------------------------------------------------------------------------
# What stays on the host, and bad arguments


def test_can_partition_on_device() -> None:
    fixed = _random_batch(1, 3).schema
    assert can_partition_on_device(fixed, "i32")
    assert can_partition_on_device(fixed, ["f16", "b", "ts", "date32"])
    assert can_partition_on_device(fixed, None)
    assert not can_partition_on_device(fixed, "dec")  # gathered on the device, hashed on the host only
    assert not can_partition_on_device(fixed, "fsb")
    assert not can_partition_on_device(fixed, "uuid")  # extension values hash by their Python form
    assert not can_partition_on_device(fixed, "missing")
    assert not can_partition_on_device(fixed, [])
    with_str = fixed.append(pa.field("s", pa.string()))
    assert not can_partition_on_device(with_str, "i32")
    assert not can_partition_on_device(with_str, None)
    with_dict = pa.schema([("k", pa.dictionary(pa.int32(), pa.int64())), ("v", pa.int64())])
    assert not can_partition_on_device(with_dict, "v")
    nested = pa.schema([("k", pa.int64()), ("l", pa.list_(pa.int64()))])
    assert not can_partition_on_device(nested, "k")


def test_string_key_is_refused(backend: Any) -> None:
    batch = pa.record_batch({"s": pa.array(["a", "b", None]), "v": pa.array([1, 2, 3])})
    db = DeviceBatch.from_arrow(batch)
    with pytest.raises(DeviceInterfaceError, match=r"key column 's'.*on the host"):
        device_destinations(db, "s", 2)
    with pytest.raises(DeviceInterfaceError, match=r"'s' \(string\).*on the host"):
        partition_device_batch(db, "v", 2)
    # the key alone hashes on the device; only the gather needs every column fixed-width
    np.testing.assert_array_equal(
        _host(backend, device_destinations(db, "v", 2)), hash_partition(batch, "v", 2)
    )


def test_dictionary_and_decimal_keys_are_refused(backend: Any) -> None:
    batch = pa.record_batch(
        {
            "d": pa.array(["x", "y", "x"]).dictionary_encode(),
            "dec": pa.array([Decimal("1.5"), None, Decimal("2")], pa.decimal128(5, 1)),
        }
    )
    db = DeviceBatch.from_arrow(batch)
    with pytest.raises(DeviceInterfaceError, match=r"'d' \(dictionary-encoded"):
        device_destinations(db, "d", 2)
    with pytest.raises(DeviceInterfaceError, match=r"'dec'"):
        device_destinations(db, "dec", 2)
    with pytest.raises(DeviceInterfaceError, match=r"cannot gather column\(s\) 'd'"):
        partition_device_batch(db, None, 2, destinations=[0, 1, 0])


def test_bad_arguments(backend: Any) -> None:
    db = DeviceBatch.from_arrow(_explicit_batch())
    for n in (0, -1):
        with pytest.raises(DissocError, match="must be positive"):
            device_destinations(db, "id", n)
        with pytest.raises(DissocError, match="must be positive"):
            partition_device_batch(db, "id", n)
    with pytest.raises(DissocError, match=r"no column 'nope' \(columns: id, f, flag, ts, x\)"):
        device_destinations(db, ["id", "nope"], 2)
    with pytest.raises(DissocError, match=r"no column 'nope'"):
        partition_device_batch(db, "nope", 2)
    with pytest.raises(DissocError, match="at least one key"):
        device_destinations(db, [], 2)
    with pytest.raises(DissocError, match="key or destinations"):
        partition_device_batch(db, "id", 2, destinations=np.zeros(10, np.int64))
    with pytest.raises(DissocError, match="key or destinations"):
        partition_device_batch(db, None, 2)
    with pytest.raises(DissocError, match="destinations for 10 rows"):
        partition_device_batch(db, None, 2, destinations=np.zeros(9, np.int64))
    with pytest.raises(DissocError, match=r"2 destinations lie outside \[0, 3\)"):
        partition_device_batch(db, None, 3, destinations=[0, 1, 2, 3, -1, 0, 0, 0, 0, 0])
    with pytest.raises(DissocError, match="must be integers"):
        partition_device_batch(db, None, 3, destinations=np.zeros(10))
    duplicated = pa.RecordBatch.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    with pytest.raises(DissocError, match="2 columns named 'a'"):
        device_destinations(DeviceBatch.from_arrow(duplicated), "a", 2)


# ------------------------------------------------------------------------------------------------ concat


def test_concat_gathers_rows_in_order_nulls_and_booleans_included(backend: Any) -> None:
    parts = [
        pa.record_batch(
            {
                "i": pa.array([1, None, 3], pa.int32()),
                "f": pa.array([0.5, 1.5, None], pa.float64()),
                "b": pa.array([True, False, None]),
                "t": pa.array([1, 2, 3], pa.timestamp("us")),
            }
        ),
        pa.record_batch(
            {
                "i": pa.array([4, 5], pa.int32()),
                "f": pa.array([2.5, 3.5], pa.float64()),
                "b": pa.array([False, True]),
                "t": pa.array([4, None], pa.timestamp("us")),
            }
        ),
        pa.record_batch(
            {
                "i": pa.array([], pa.int32()),
                "f": pa.array([], pa.float64()),
                "b": pa.array([], pa.bool_()),
                "t": pa.array([], pa.timestamp("us")),
            }
        ),
    ]
    device = [DeviceBatch.from_arrow(p) for p in parts]
    got = concat_device_batches(device).to_arrow()
    assert got.equals(pa.Table.from_batches(parts).combine_chunks().to_batches()[0])
    assert concat_device_batches(device[:1]) is device[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concat_of_every_gatherable_kind_is_the_rows_in_order(backend: Any, seed: int) -> None:
    parts = [_random_batch(seed * 3 + k, rows) for k, rows in enumerate([37, 0, 64, 5])]
    got = concat_device_batches([DeviceBatch.from_arrow(p) for p in parts]).to_arrow()
    want = pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
    assert_same_rows(got, want, "concat")  # NaN-aware, unlike equals


def test_concat_refuses_what_it_cannot_gather(backend: Any) -> None:
    a = DeviceBatch.from_arrow(pa.record_batch({"x": pa.array([1], pa.int64())}))
    b = DeviceBatch.from_arrow(pa.record_batch({"y": pa.array([1], pa.int64())}))
    s = DeviceBatch.from_arrow(pa.record_batch({"s": pa.array(["a"])}))
    with pytest.raises(DissocError, match="different schemas"):
        concat_device_batches([a, b])
    with pytest.raises(DeviceInterfaceError):
        concat_device_batches([s, s])
    with pytest.raises(DissocError, match="at least one"):
        concat_device_batches([])
