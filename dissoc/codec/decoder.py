"""Decoding: Message metadata and a body given as separate arguments -> ``pyarrow.RecordBatch``.

This is the push decoder that Dissociated IPC needs: it never reads anything itself, it is handed the metadata
and, for batches, the body (packed bytes, or memory the caller mapped). Uncompressed little-endian bodies are
never copied: arrays are built over the body through the C Data Interface (see :mod:`dissoc.codec.cdata`).

The work is shared with: :mod:`dissoc.codec.message` (parsing the Message flatbuffer, :func:`parse`),
:mod:`dissoc.codec.plan` (what a schema and a batch's metadata fix, cached), :mod:`dissoc.codec.sizes` (the
bytes each buffer needs), :mod:`dissoc.codec.checks` (content checks), :mod:`dissoc.codec.compression` and
:mod:`dissoc.codec.byteswap` (the slow path for compressed or big-endian bodies).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec import cdata
from dissoc.codec.byteswap import swap
from dissoc.codec.checks import check_node, check_run_ends
from dissoc.codec.compression import decompress_buffer
from dissoc.codec.ipcread import (
    NOTHING as _NOTHING,
)
from dissoc.codec.ipcread import (
    FramedSource,
    distinct_sizes,
    frame_head,
    frame_parts,
    frame_room,
)
from dissoc.codec.jit import SPAN_FIELDS, binary_check
from dissoc.codec.message import HeaderType, ParsedMessage, RecordBatchHeader, message_template, parse
from dissoc.codec.plan import (
    SCHEMAS,
    SCHEMAS_LOCK,
    SUB_READ_MIN_NODES,
    Compiled,
    Prepared,
    build_template,
    exclusive_cumsum,
    remember,
)
from dissoc.codec.schema import Layout, SchemaInfo, decode_schema, map_type
from dissoc.codec.sizes import (
    DATA,
    OFF4,
    OFF8,
    VIEWS,
    decompressed_bound,
    last_offset,
    long_view_bytes,
    required_sizes,
    roles,
    size_rules,
)
from dissoc.errors import CodecError

__all__ = ["Landing", "MessageDecoder", "ParsedMessage", "ScatteredBody", "frame_room", "parse"]

log = logging.getLogger(__name__)

_read_message = pa.ipc.read_message
_read_record_batch = pa.ipc.read_record_batch


def _concat(a: pa.Array, b: pa.Array) -> pa.Array:
    """``a`` followed by ``b``. pyarrow cannot concatenate extension types nested in others: those are joined
    as their storage types (the same memory, viewed through the C Data Interface) and viewed back."""
    try:
        return pa.concat_arrays([a, b])
    except pa.ArrowNotImplementedError:
        storage = _storage_type(a.type)
        if storage.equals(a.type):
            raise
        return cdata.view_as(pa.concat_arrays([cdata.view_as(a, storage), cdata.view_as(b, storage)]), a.type)


def _storage_type(ty: pa.DataType) -> pa.DataType:
    """``ty`` with every extension type replaced by its storage type."""
    return map_type(
        ty, lambda t: _storage_type(t.storage_type) if isinstance(t, pa.BaseExtensionType) else None
    )


class ScatteredBody:
    """A message body given as one buffer per entry of the metadata's ``buffers`` (None or empty for an
    empty one), wherever each lies: what address/length pair lists describe."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list[pa.Buffer | None]) -> None:
        self.buffers = buffers


_EMPTY_BODY = pa.py_buffer(b"")
_UNKNOWN = object()


class Landing:
    """How a batch of one metadata message decodes once its body has landed: for layouts that the metadata
    alone settles (fixed-width columns, sizes checked, nothing in the contents to check), what the room before
    the body must hold, and one pyarrow read of room and body (see :meth:`MessageDecoder.landing`).

    ``head`` is ``room`` bytes: the encapsulation framing and the metadata. The buffer given to :meth:`read`
    starts with them, then holds at least ``need - room`` bytes of body. Nothing of it needs to be mutable
    (unlike :meth:`MessageDecoder.decode_landed`'s landing), so a slice of a larger allocation will do.
    """

    __slots__ = ("_decoder", "_key", "_prep", "_schema", "head", "need", "room")

    def __init__(self, decoder: MessageDecoder, key: bytes, prep: Prepared) -> None:
        self.head = bytes(prep.head)
        self.room = len(self.head)
        self.need = self.room + prep.body_length
        self._schema = prep.compiled.schema
        self._decoder = decoder
        self._key = key
        self._prep = prep

    def read(self, framed: pa.Buffer) -> pa.RecordBatch:
        """The batch over ``framed`` (``head``, then the body), without a copy."""
        if framed.size < self.need:
            got = framed.size - self.room
            raise CodecError(f"message body: expected {self.need - self.room} bytes, got {got}")
        try:
            return _read_record_batch(_read_message(framed), self._schema)
        except (pa.ArrowException, ValueError, TypeError, OSError):
            return self._decoder._landing_refused(self._key, self._prep, framed.slice(self.room))


class MessageDecoder:
    """Decode a stream of Message metadata (+ bodies) into ``pa.RecordBatch`` objects.

    Call :meth:`decode` once per message, in stream order. Schema and dictionary messages return ``None``;
    record batches return a ``pa.RecordBatch`` built over ``body`` without copying it (uncompressed,
    little-endian data). With ``validate`` (the default) offsets, views, union ids, dictionary indices and run
    ends are checked (see :mod:`dissoc.codec.checks`), so that malformed data from the wire raises
    :class:`CodecError` instead of producing arrays that read out of bounds; buffer sizes are always checked.
    Turn it off only for trusted producers.

    With ``ipc_reader`` (the default), batches in packed, uncompressed little-endian host bodies whose layout
    our checks accepted are built by pyarrow's C++ IPC reader, still over the body received (see
    :mod:`dissoc.codec.ipcread`); the others (dictionary-encoded columns, compressed or big-endian bodies, V4
    unions, scattered bodies) through the C Data Interface, as every batch is with ``ipc_reader=False``. The
    same checks run either way. A receiver that can put the body right after some headroom gets the
    cheapest decode with :meth:`decode_landed`.
    """

    def __init__(
        self,
        *,
        validate: bool = True,
        max_buffer_bytes: int = 1 << 34,
        allow_dictionary_replacement: bool = True,
        schema: pa.Schema | None = None,
        ipc_reader: bool = True,
    ) -> None:
        self.validate = validate
        #: Whether eligible batches are built by pyarrow's IPC reader (False: all by the C Data Interface).
        self.ipc_reader = ipc_reader
        self.max_buffer_bytes = max_buffer_bytes
        self.allow_dictionary_replacement = allow_dictionary_replacement
        self._info: SchemaInfo | None = None
        self._compiled: Compiled | None = None
        self._dict_compiled: dict[int, Compiled] = {}
        self._prepared: dict[bytes, Prepared] = {}
        self._landings: dict[bytes, Landing | None] = {}
        self._parsed: dict[bytes, ParsedMessage] = {}
        self.dictionaries: dict[int, pa.Array] = {}
        self._version = 4
        # Sources pyarrow reads messages from, one per batch being decoded: taken for a call and given back,
        # so that calls from several threads never share one (list.pop and append are atomic).
        self._sources: list[FramedSource] = []
        if schema is not None:
            raise CodecError("MessageDecoder(schema=...) is not supported: decode the schema message first")

    @property
    def schema(self) -> pa.Schema | None:
        """The stream's schema, once its Schema message has been decoded."""
        return None if self._info is None else self._info.schema

    @property
    def schema_info(self) -> SchemaInfo | None:
        return self._info

    @property
    def checks_contents(self) -> bool:
        """Whether this stream's batches have contents to check (offsets, views, union ids, dictionary
        indices, run ends): False for schemas of fixed-width columns only, whose memory safety the sizes
        checked from the metadata already guarantee."""
        c = self._compiled
        return c is not None and bool(c.checked_all or c.full_columns or c.dict_nodes)

    def decode(self, metadata: object, body: object = None) -> pa.RecordBatch | None:
        """Decode one message; ``body`` is bytes-like (or a ``pa.Buffer``) for batch messages.

        Streams of same-shaped batches repeat their metadata byte for byte: the parsed header and the
        prepared layout are cached per metadata, so such a batch costs little more than pointing the cached
        layout at its body (the body's contents are still checked every time). Decoded schemas, and with
        them those caches, are shared by the decoders of a process.
        """
        if type(metadata) is bytes:
            key: bytes | None = metadata
        else:
            key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        if key is not None:
            prep = self._prepared.get(key)
            # a batch layout checked before: straight to pyarrow's reader
            if (
                prep is not None
                and prep.frame is not None
                and self.ipc_reader
                and type(body) is not ScatteredBody
            ):
                return self._decode_ipc(prep, body)
        if key is not None and self._info is None:
            known = SCHEMAS.get(key)
            if known is not None:
                self._use_schema(*known)
                return None
        return self.decode_parsed(self._parse_cached(metadata, key), body, key)

    def _parse_cached(self, metadata: object, key: bytes | None) -> ParsedMessage:
        msg = self._parsed.get(key) if key is not None else None
        if msg is None:
            msg = parse(metadata)
            if key is not None and msg.header_type == HeaderType.RecordBatch:
                remember(self._parsed, key, msg)
        return msg

    def has_body(self, metadata: object) -> bool:
        """Whether a message carries a body on the data stream (parsing through this decoder's cache)."""
        if type(metadata) is bytes and metadata in self._parsed:  # (only batches are kept there)
            return True
        key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        return self._parse_cached(metadata, key).has_body

    def decode_parsed(
        self, msg: ParsedMessage, body: object = None, key: bytes | None = None
    ) -> pa.RecordBatch | None:
        info = msg.info
        if info.header_type == HeaderType.Schema:
            if self._info is not None:
                raise CodecError("a second Schema message arrived; a stream has exactly one")
            assert info.header is not None
            self.set_schema(decode_schema(info.header, info.version), info.version)
            if key is not None:
                assert self._info is not None and self._compiled is not None
                with SCHEMAS_LOCK:
                    remember(SCHEMAS, key, (self._info, self._version, self._compiled))
            return None
        if self._info is None:
            raise CodecError(
                f"a {HeaderType(info.header_type).name} message arrived before the Schema message"
            )
        buf: pa.Buffer | ScatteredBody = body if isinstance(body, ScatteredBody) else _as_buffer(body)
        if not isinstance(buf, ScatteredBody) and buf.size < info.body_length:
            raise CodecError(f"message body: expected {info.body_length} bytes, got {buf.size}")
        assert msg.batch is not None
        if info.header_type == HeaderType.DictionaryBatch:
            assert msg.dictionary_id is not None
            self._decode_dictionary(msg.dictionary_id, msg.is_delta, msg.batch, buf, info.body_length)
            return None
        assert self._compiled is not None
        return self._decode_batch(self._compiled, msg.batch, buf, info.body_length, key)

    def set_schema(self, info: SchemaInfo, version: int = 4) -> None:
        """Start decoding with a schema decoded elsewhere (e.g. from a file footer)."""
        self._use_schema(info, version, Compiled(info.plans, info.schema, version < 4))

    def _use_schema(self, info: SchemaInfo, version: int, compiled: Compiled) -> None:
        self._info = info
        self._version = version
        self._compiled = compiled
        self._prepared = compiled.prepared
        self._parsed = compiled.parsed

    # ------------------------------------------------------------------------------------------ dictionaries

    def _decode_dictionary(
        self,
        dict_id: int,
        is_delta: bool,
        header: RecordBatchHeader,
        body: pa.Buffer | ScatteredBody,
        body_length: int,
    ) -> None:
        assert self._info is not None
        dinfo = self._info.dictionaries.get(dict_id)
        if dinfo is None:
            known = sorted(self._info.dictionaries)
            raise CodecError(f"DictionaryBatch: id {dict_id} is not in the schema (known ids: {known})")
        compiled = self._dict_compiled.get(dict_id)
        if compiled is None:
            compiled = Compiled([dinfo.value_plan], pa.schema([dinfo.value_plan.field]), self._version < 4)
            self._dict_compiled[dict_id] = compiled
        values = self._decode_batch(compiled, header, body, body_length).column(0)
        prev = self.dictionaries.get(dict_id)
        if is_delta:
            if prev is None:
                raise CodecError(f"DictionaryBatch: delta for id {dict_id} before any dictionary for it")
            try:
                values = _concat(prev, values)
            except pa.ArrowException as e:
                raise CodecError(f"DictionaryBatch: cannot apply delta to id {dict_id}: {e}") from None
        elif prev is not None and not self.allow_dictionary_replacement:
            raise CodecError(
                f"DictionaryBatch: replacement of dictionary id {dict_id} is not allowed in the file format"
            )
        log.debug("dictionary id=%#x delta=%s length=%d", dict_id, is_delta, len(values))
        self.dictionaries[dict_id] = values

    # ------------------------------------------------------------------------------------------ batches

    def _decode_batch(
        self,
        c: Compiled,
        h: RecordBatchHeader,
        body: pa.Buffer | ScatteredBody,
        body_length: int,
        key: bytes | None = None,
    ) -> pa.RecordBatch:
        assert self._info is not None
        if isinstance(body, ScatteredBody):
            return self._decode_scattered(c, h, body, body_length, key)
        if h.compression is not None or self._info.big_endian:
            return self._decode_general(c, h, body, body_length)
        prep = self._prepared_layout(c, h, body_length, key)
        if prep.frame is not None and self.ipc_reader:
            return self._decode_ipc(prep, body)
        return self._instantiate(c, prep, body)

    def _prepared_layout(
        self, c: Compiled, h: RecordBatchHeader, body_length: int, key: bytes | None
    ) -> Prepared:
        """The prepared layout of an uncompressed little-endian batch (cached per metadata ``key``)."""
        cache = self._prepared
        prep = cache.get(key) if key is not None else None
        if prep is None or prep.compiled is not c:
            prep = self._prepare(c, h, body_length)
            if key is not None:
                # (pyarrow's reader refuses buffers at offsets that are not multiples of 8)
                frame = frame_parts(key)
                if c.ipc_ok and not bool((h.buffers[:, 0] & 7).any()) and distinct_sizes(frame, body_length):
                    prep.frame = frame
                    prep.head = memoryview(frame_head(key)).cast("b")  # as memoryview(pa.Buffer)
                    if prep.as_binary and c.n_nodes - len(c.sub_nodes) >= SUB_READ_MIN_NODES:
                        prep.sub = _sub_frame(c, h, body_length, len(key))
                    prep.rest_checked = c.rest_flat and _rest_in_shape(c, h)
                    if c.binary_nodes is not None and prep.rest_checked:
                        prep.spans = _binary_spans(c, h, prep)
                remember(cache, key, prep)
        return prep

    # ------------------------------------------------------------------------- through pyarrow's IPC reader

    def _decode_ipc(self, prep: Prepared, body: object) -> pa.RecordBatch:
        """A batch whose layout is checked and cached (``prep.frame`` set), built by pyarrow over ``body``."""
        c = prep.compiled
        need = prep.body_length
        buf: pa.Buffer | None = None
        if type(body) is bytes:
            size = len(body)
        else:
            buf = body if isinstance(body, pa.Buffer) else _as_buffer(body)
            size = buf.size
        if size < need:
            raise CodecError(f"message body: expected {need} bytes, got {size}")
        piece: object
        if buf is None:
            piece = body if size == need else memoryview(body)[:need]  # type: ignore[arg-type]
        else:
            piece = buf if size == need else buf.slice(0, need)
        validate = self.validate
        if validate:
            checked = c.checked if prep.small else c.checked_all
            if checked:
                if buf is None:
                    buf = pa.py_buffer(body)
                self._check(
                    c,
                    prep.nodes,
                    prep.nbuf,
                    prep.first,
                    prep.offsets + np.uint64(buf.address),
                    prep.lengths,
                    checked,
                )
        frame = prep.frame
        assert frame is not None
        try:
            message = self._framed_message(frame, piece, need)
            batch = _read_record_batch(message, c.schema)
        except (pa.ArrowException, ValueError, TypeError, OSError):
            # pyarrow refuses what our checks accepted: our codec decides, on the C Data Interface path
            return self._ipc_refused(prep, buf if buf is not None else pa.py_buffer(body))
        return self._finish_ipc(prep, batch, message, piece)

    def _framed_message(self, frame: tuple[bytes, bytes], piece: object, need: int) -> pa.ipc.Message:
        """pyarrow's Message of the framing pieces ``frame`` and the body ``piece`` (``need`` bytes), read
        through one of the decoder's :class:`FramedSource` objects (given back once the read succeeded)."""
        sources = self._sources
        source = sources.pop() if sources else FramedSource()
        # pyarrow asks for the length, the metadata and the body by size: a dict lookup answers each
        source.read = {4: frame[0], len(frame[1]): frame[1], need: piece}.get
        try:
            message = _read_message(source.file)
        finally:
            source.read = _NOTHING
        sources.append(source)
        return message

    def _ipc_refused(self, prep: Prepared, body: pa.Buffer) -> pa.RecordBatch:
        log.debug("pyarrow's IPC reader refused a checked layout; decoding it through the C Data Interface")
        prep.frame = None
        return self._instantiate(prep.compiled, prep, body)

    def _validate_ipc(
        self, prep: Prepared, batch: pa.RecordBatch, message: pa.ipc.Message, body: object, at: int = 0
    ) -> None:
        """The content checks of a small batch with fully validated columns that pyarrow's IPC reader built
        from ``message`` over ``body`` (whose first ``at`` bytes come before the message body).

        Its data buffers are the metadata's (not sized from the offsets, as the C importer sizes them), so
        full validation sees binary offsets past the data received, which :meth:`_check_offset_bounds` checks
        on the other path; that check runs here only once validation failed, to say what is wrong the same
        way. Top-level string columns are validated as binary plus an ASCII check of their data (see
        :attr:`Compiled.str_columns`), which accepts and refuses exactly what string validation does."""
        c = prep.compiled
        spans = prep.spans
        if spans is not None:
            check = binary_check()
            if check is not None and check(np.frombuffer(body, np.uint8), at, spans):  # type: ignore[call-overload]
                return  # (anything it does not pass takes the route below, which words the error)
        try:
            if prep.sub is not None:
                # the risky columns alone under binary types: their full checks but UTF-8, which _ascii
                # makes; the other columns get the cheap validation where their shape does not settle it
                self._read_sub(prep, body, at).validate(full=True)
                if not prep.rest_checked:
                    batch.validate()
                if not _ascii(prep, body, at):
                    batch.select(c.str_columns).validate(full=True)
            elif prep.as_binary:
                # the same layout under binary types: the same checks but UTF-8, which _ascii makes
                as_bin = _read_record_batch(message, c.bin_schema)
                if c.whole_full:
                    as_bin.validate(full=True)
                else:
                    as_bin.validate()
                    as_bin.select(c.full_columns).validate(full=True)
                if not _ascii(prep, body, at):
                    batch.select(c.str_columns).validate(full=True)
            elif c.whole_full:
                batch.validate(full=True)  # includes the cheap validation
            else:
                batch.validate()
                batch.select(c.full_columns).validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            if self.validate and prep.small and c.offset_bounds:
                address = body.address if isinstance(body, pa.Buffer) else pa.py_buffer(body).address
                self._check_offset_bounds(c, prep, address + at)
            raise CodecError(f"RecordBatch: invalid data: {e}") from None

    def _read_sub(self, prep: Prepared, body: object, at: int) -> pa.RecordBatch:
        """The batch of ``prep.sub``'s message (the risky columns, strings as binary) over ``body``: written
        into the room of a landed body (``at`` > 0; the batch's own framing there is spent by then), else
        ``body`` is the message's body, exactly, read through a :class:`FramedSource`."""
        assert prep.sub is not None
        frame, head = prep.sub
        try:
            if at:
                memoryview(body)[:at] = head  # type: ignore[arg-type]
                message = _read_message(body)
            else:
                message = self._framed_message(frame, body, prep.body_length)
            return _read_record_batch(message, prep.compiled.sub_schema)
        except (TypeError, OSError) as e:  # (pa.ArrowException and ValueError are the caller's)
            raise CodecError(f"RecordBatch: invalid data: {e}") from None

    def landing(self, metadata: bytes) -> Landing | None:
        """A :class:`Landing` for batches of ``metadata``: where its layout leaves nothing to check in a body
        (fixed-width columns whose sizes the metadata settles, no content checks), so that a receiver can land
        each body in a slab of its own and decode it with one read. None otherwise (then
        :meth:`decode_landed` or :meth:`decode`). The layout is prepared from the metadata alone when no
        batch of it was decoded yet (the schema must have been); metadata that does not prepare (not a
        batch, malformed) gets None here, and its decode says what is wrong."""
        got = self._landings.get(metadata, _UNKNOWN)
        if got is not _UNKNOWN:
            return got  # type: ignore[return-value]
        prep = self._prepared.get(metadata)
        if prep is None:
            prep = self._prepare_unseen(metadata)
            if prep is None:
                return None  # (nothing to remember: its decode decides)
        # shape_checked layouts are fixed-width columns only: no content checks, no full validation after
        plain = self.ipc_reader and prep.frame is not None and prep.shape_checked
        found = Landing(self, metadata, prep) if plain else None
        remember(self._landings, metadata, found)
        return found

    def _prepare_unseen(self, metadata: bytes) -> Prepared | None:
        """The prepared layout of batch ``metadata`` before any body of it came, where it has one."""
        c = self._compiled
        info = self._info
        if c is None or info is None or info.big_endian or type(metadata) is not bytes:
            return None
        try:
            msg = self._parse_cached(metadata, metadata)
            h = msg.batch
            if msg.header_type != HeaderType.RecordBatch or h is None or h.compression is not None:
                return None
            return self._prepared_layout(c, h, msg.info.body_length, metadata)
        except (CodecError, pa.ArrowException, ValueError):
            return None

    def _landing_refused(self, key: bytes, prep: Prepared, body: pa.Buffer) -> pa.RecordBatch:
        self._landings[key] = None  # (prep.frame is None from now on: the C Data Interface path)
        return self._ipc_refused(prep, body)

    def decode_landed(self, metadata: object, landing: pa.Buffer) -> pa.RecordBatch | None:
        """Decode one message whose body was landed after ``frame_room(len(metadata))`` spare bytes.

        ``landing`` is one writable allocation: ``frame_room(len(metadata))`` bytes of room (their contents
        are overwritten), then the body. For a batch whose metadata this decoder has seen before, the
        encapsulation framing and the metadata are written into the room and pyarrow reads the whole
        allocation as one message, so nothing is copied and nothing is read through Python; everything else
        decodes as ``decode(metadata, landing.slice(room))`` would. The same checks run either way.
        """
        if not isinstance(landing, pa.Buffer):
            raise CodecError(f"the landing must be a pa.Buffer, got {type(landing).__name__}")
        if type(metadata) is bytes:
            key = metadata
        elif isinstance(metadata, (bytes, memoryview)):
            key = bytes(metadata)
        else:
            raise CodecError(f"metadata must be bytes-like, got {type(metadata).__name__}")
        prep = self._prepared.get(key)
        size = landing.size
        if prep is None or prep.frame is None or not self.ipc_reader or not landing.is_mutable:
            room = frame_room(len(key))
            if size < room:
                raise CodecError(f"the landing holds {size} bytes, less than the {room} bytes of room")
            return self.decode(key, landing.slice(room))
        c = prep.compiled
        head = prep.head
        room = len(head)  # frame_room(len(key))
        if size - room < prep.body_length:
            if size < room:
                raise CodecError(f"the landing holds {size} bytes, less than the {room} bytes of room")
            raise CodecError(f"message body: expected {prep.body_length} bytes, got {size - room}")
        validate = self.validate
        if validate:
            checked = c.checked if prep.small else c.checked_all
            if checked:
                at = np.uint64(landing.address + room)
                self._check(c, prep.nodes, prep.nbuf, prep.first, prep.offsets + at, prep.lengths, checked)
        memoryview(landing)[:room] = head  # the framing and metadata, into the room
        try:
            message = _read_message(landing)
            batch = _read_record_batch(message, c.schema)
        except (pa.ArrowException, ValueError, TypeError, OSError):
            return self._ipc_refused(prep, landing.slice(room))
        if prep.shape_checked and not (validate and prep.small and c.full_columns):
            return batch  # (nothing left for _finish_ipc to check)
        return self._finish_ipc(prep, batch, message, landing, room)

    def _finish_ipc(
        self, prep: Prepared, batch: pa.RecordBatch, message: pa.ipc.Message, body: object, at: int = 0
    ) -> pa.RecordBatch:
        """The checks left after pyarrow's reader built ``batch``: pyarrow's full validation of a small batch
        with such columns (:meth:`_validate_ipc`), else its cheap one where the metadata did not settle the
        shape already."""
        if self.validate and prep.small and prep.compiled.full_columns:
            self._validate_ipc(prep, batch, message, body, at)
        elif not prep.shape_checked:
            try:
                batch.validate()
            except (pa.ArrowException, ValueError) as e:
                raise CodecError(f"RecordBatch: invalid data: {e}") from None
        return batch

    def _layout(self, c: Compiled, h: RecordBatchHeader, limit: int) -> npt.NDArray[np.int64]:
        """Check the header against the schema and a ``limit``-byte body; returns IPC buffers per node."""
        nodes = h.nodes
        if len(nodes) != c.n_nodes:
            raise CodecError(
                f"RecordBatch: the schema has {c.n_nodes} field nodes, the message lists {len(nodes)}"
            )
        nbuf = c.nbuf_ipc
        if c.view_nodes.size:
            vc = h.variadic_counts
            if vc is None or len(vc) != len(c.view_nodes):
                raise CodecError(
                    f"RecordBatch: {len(c.view_nodes)} view fields need as many variadicBufferCounts, "
                    f"got {0 if vc is None else len(vc)}"
                )
            if int(vc.max()) > 1 << 20:
                raise CodecError(f"RecordBatch: variadicBufferCounts {int(vc.max())} is implausibly large")
            nbuf = nbuf.copy()
            nbuf[c.view_nodes] += vc
        elif h.variadic_counts is not None and len(h.variadic_counts):
            raise CodecError(
                f"RecordBatch: variadicBufferCounts has {len(h.variadic_counts)} entries, the schema no views"
            )
        if c.nullless_nodes.size and bool(nodes[c.nullless_nodes, 1].any()):
            bad = int(c.nullless_nodes[np.flatnonzero(nodes[c.nullless_nodes, 1])[0]])
            raise CodecError(
                f"RecordBatch: field node {bad} has null count {int(nodes[bad, 1])}, but its layout has no "
                "validity bitmap (its nulls are its children's)"
            )
        buffers = h.buffers
        total = int(nbuf.sum()) if c.view_nodes.size else c.total_buffers
        if len(buffers) != total:
            raise CodecError(
                f"RecordBatch: the schema needs {total} buffers, the message lists {len(buffers)}"
            )
        offs = buffers[:, 0]
        lens = buffers[:, 1]
        # Both columns are >= 0 (checked when parsed), so once neither exceeds the limit their sum cannot
        # overflow.
        if len(buffers) and (int(buffers.max()) > limit or int((offs + lens).max()) > limit):
            bad = int(np.flatnonzero((lens > limit) | (offs > limit - lens))[0])
            raise CodecError(
                f"RecordBatch: buffer {bad} (offset {int(offs[bad])}, length {int(lens[bad])}) lies outside "
                f"the {limit}-byte body"
            )
        return nbuf

    def _prepare(self, c: Compiled, h: RecordBatchHeader, body_length: int) -> Prepared:
        """Everything about an uncompressed batch that depends on its metadata alone (cached per metadata)."""
        nbuf = self._layout(c, h, body_length)
        self._check_sizes(c, h.nodes, nbuf, h.buffers[:, 1])
        return build_template(c, h, nbuf, h.buffers[:, 0].astype(np.uint64), h.buffers[:, 1], body_length)

    def _instantiate(self, c: Compiled, prep: Prepared, body: pa.Buffer) -> pa.RecordBatch:
        """A batch from a prepared layout and a body: copy the template, point it at the body, import."""
        if body.size < prep.body_length:
            raise CodecError(f"message body: expected {prep.body_length} bytes, got {body.size}")
        for _, did in c.dict_nodes:
            if did not in self.dictionaries:
                raise CodecError(
                    f"RecordBatch: dictionary id {did} is used before any DictionaryBatch for it"
                )
        address = 0 if prep.absolute else body.address
        small = prep.small
        checked = c.checked if small else c.checked_all
        if checked and self.validate:
            self._check(
                c, prep.nodes, prep.nbuf, prep.first, prep.offsets + np.uint64(address), prep.lengths, checked
            )
        if small and c.offset_bounds and self.validate:
            self._check_offset_bounds(c, prep, address)
        keep = cdata.Keepalive()
        mem = pa.allocate_buffer(8 * len(prep.words))
        keep.objects += (body, mem, *prep.extra)
        words = np.frombuffer(mem, np.uint64)
        words[:] = prep.words
        base = mem.address
        words[prep.mem_index] += np.uint64(base)
        words[prep.body_index] += np.uint64(address)
        structs = words[: 10 * (c.n_nodes + 1)].reshape(c.n_nodes + 1, 10)
        for i, did in c.dict_nodes:
            structs[i + 1, 7] = cdata.export_array(self.dictionaries[did], keep)
        try:
            batch = cdata.import_batch(structs, base, c.schema, keep, c.dict_owners)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise CodecError(f"RecordBatch: invalid layout: {e}") from None
        self._validate(c, batch, small)
        return batch

    def decode_scattered(self, metadata: object, buffers: list[pa.Buffer | None]) -> pa.RecordBatch | None:
        """Decode a message whose body buffers lie apart (one per metadata buffer entry), without copying."""
        key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        return self.decode_parsed(self._parse_cached(metadata, key), ScatteredBody(buffers), key)

    def _decode_scattered(
        self, c: Compiled, h: RecordBatchHeader, body: ScatteredBody, body_length: int, key: bytes | None
    ) -> pa.RecordBatch:
        assert self._info is not None
        if h.compression is not None or self._info.big_endian:
            raise CodecError("scattered bodies (address/length pairs) must be uncompressed and little-endian")
        buffers = body.buffers
        if len(buffers) != len(h.buffers):
            raise CodecError(f"the metadata lists {len(h.buffers)} buffers, the body has {len(buffers)}")
        lengths = np.array([0 if b is None else b.size for b in buffers], np.int64)
        if len(lengths) and bool((lengths != h.buffers[:, 1]).any()):
            k = int(np.flatnonzero(lengths != h.buffers[:, 1])[0])
            raise CodecError(
                f"body buffer {k} holds {int(lengths[k])} bytes, the metadata says {int(h.buffers[k, 1])}"
            )
        addresses = np.array([0 if b is None or b.size == 0 else b.address for b in buffers], np.uint64)
        extra = [b for b in buffers if b is not None]
        cached = c.scattered.get(key) if key is not None and c.simple else None
        if cached is None:
            nbuf = self._layout(c, h, body_length)
            self._check_sizes(c, h.nodes, nbuf, lengths)
            if key is None or not c.simple:
                prep = build_template(c, h, nbuf, addresses, lengths, None)
                prep.extra.extend(extra)
                return self._instantiate(c, prep, _EMPTY_BODY)
            # Same metadata, same layout: only the buffers' addresses change from batch to batch. Keep the
            # struct tree with the pointer words to fill in (non-empty buffers, except the validity bitmaps of
            # nodes without nulls, which stay NULL as build_template makes them).
            template = build_template(c, h, nbuf, np.zeros(len(lengths), np.uint64), lengths, None)
            take = lengths > 0
            vnodes = np.flatnonzero(c.has_validity & (h.nodes[:, 1] == 0))
            if vnodes.size:
                take[exclusive_cumsum(nbuf)[vnodes]] = False
            positions = (np.flatnonzero(take) + 10 * (c.n_nodes + 1) + 1).astype(np.intp)
            cached = (template, positions, take)
            remember(c.scattered, key, cached)
        template, positions, take = cached
        words = template.words.copy()
        words[positions] = addresses[take]
        prep = dataclasses.replace(template, words=words, offsets=addresses, extra=extra)
        return self._instantiate(c, prep, _EMPTY_BODY)

    def _decode_general(
        self, c: Compiled, h: RecordBatchHeader, body: pa.Buffer, body_length: int
    ) -> pa.RecordBatch:
        """Compressed or big-endian bodies: buffers are rewritten into new memory first."""
        nbuf = self._layout(c, h, min(body.size, body_length))
        keep = cdata.Keepalive()
        addresses = h.buffers[:, 0].astype(np.uint64) + np.uint64(body.address)
        addresses, lengths = self._transform_buffers(
            c, h, nbuf, exclusive_cumsum(nbuf), body, addresses, keep
        )
        self._check_sizes(c, h.nodes, nbuf, lengths)
        prep = build_template(c, h, nbuf, addresses, lengths, None)
        prep.extra.extend(keep.objects)
        return self._instantiate(c, prep, body)

    def _validate(self, c: Compiled, batch: pa.RecordBatch, small: bool) -> None:
        try:
            batch.validate()
            if self.validate and c.full_columns and small:
                (batch if c.all_full else batch.select(c.full_columns)).validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            raise CodecError(f"RecordBatch: invalid data: {e}") from None

    @staticmethod
    def _check_offset_bounds(c: Compiled, prep: Prepared, address: int) -> None:
        """A binary node's offsets start at >= 0 and end within the data received (pyarrow's full validation,
        which follows, checks the offsets in between against those two)."""
        for i, width in c.offset_bounds:
            length = int(prep.nodes[i, 0])
            if length == 0:
                continue
            k = int(prep.first[i])
            at = int(prep.offsets[k + 1]) + address
            ctype = ctypes.c_int64 if width == 8 else ctypes.c_int32
            first = ctype.from_address(at).value
            last = ctype.from_address(at + length * width).value
            limit = int(prep.lengths[k + 2])
            if first < 0 or last > limit or last < first:
                raise CodecError(
                    f"field {c.flat[i].field.name!r}: offsets must rise from >= 0 to at most {limit}, got "
                    f"first {first}, last {last}"
                )

    def _check_sizes(
        self,
        c: Compiled,
        nodes: npt.NDArray[np.int64],
        nbuf: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> None:
        """Every buffer must hold what Arrow will read for its node's length (Arrow's importer trusts us)."""
        rules = c.size_rules if c.size_rules is not None else size_rules(c.flat, nbuf, c.drop_first)
        req = required_sizes(rules, nodes)
        if len(req) and bool((lengths < req).any()):
            k = int(np.flatnonzero(lengths < req)[0])
            i = int(rules.node[k])
            raise CodecError(
                f"RecordBatch: buffer {k} of field {c.flat[i].field.name!r} (length {int(nodes[i, 0])}) "
                f"holds "
                f"{int(lengths[k])} bytes, {int(req[k])} are needed"
            )

    def _check(
        self,
        c: Compiled,
        nodes: npt.NDArray[np.int64],
        nbuf: npt.NDArray[np.int64],
        first: npt.NDArray[np.int64],
        addrs: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.int64],
        checked: list[int],
    ) -> None:
        for i in checked:
            p = c.flat[i]
            s = int(first[i] + c.drop_first[i])
            e = int(first[i] + nbuf[i])
            kids = c.child_nodes[i]
            length = int(nodes[i, 0])
            name = f"field {p.field.name!r}"
            if p.layout == Layout.RUN_END:
                r, v = kids
                k = int(first[r]) + 1
                check_run_ends(
                    name,
                    length,
                    int(addrs[k]),
                    int(lengths[k]),
                    int(nodes[r, 0]),
                    c.flat[r].width,
                    int(nodes[v, 0]),
                )
                continue
            dlen = len(self.dictionaries[p.dict_id]) if p.dict_id in self.dictionaries else 0
            check_node(
                p,
                name,
                length,
                int(nodes[i, 1]),
                addrs[s:e].tolist(),
                lengths[s:e].tolist(),
                [int(nodes[k, 0]) for k in kids],
                dlen,
            )

    def _transform_buffers(
        self,
        c: Compiled,
        h: RecordBatchHeader,
        nbuf: npt.NDArray[np.int64],
        first: npt.NDArray[np.int64],
        body: pa.Buffer,
        addrs: npt.NDArray[np.uint64],
        keep: cdata.Keepalive,
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
        """Decompress and/or byte-swap buffers into new memory (the slow path)."""
        assert self._info is not None
        mv = memoryview(body)
        lens = h.buffers[:, 1].copy()
        nodes = h.nodes
        for i, p in enumerate(c.flat):
            length = int(nodes[i, 0])
            s = int(first[i])
            data_limit = self.max_buffer_bytes  # what this node's offsets or views justify for its data
            for j, role in enumerate(roles(p, int(nbuf[i]), bool(c.drop_first[i]))):
                k = s + j
                off, n = int(h.buffers[k, 0]), int(h.buffers[k, 1])
                raw = mv[off : off + n]
                data: memoryview | npt.NDArray[np.uint8] = raw
                if h.compression is not None:
                    limit = (
                        data_limit
                        if role == DATA
                        else decompressed_bound(role, p, length, self.max_buffer_bytes)
                    )
                    data = decompress_buffer(h.compression, raw, limit)
                if self._info.big_endian:
                    data = swap(role, p, data)
                if role in (OFF4, OFF8) and p.layout in (Layout.BINARY, Layout.LARGE_BINARY):
                    data_limit = last_offset(data, 4 if role == OFF4 else 8, length)
                elif role == VIEWS:
                    data_limit = long_view_bytes(data, length)
                if data is not raw:
                    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
                    keep.objects.append(arr)
                    addrs[k] = arr.ctypes.data if arr.size else np.uint64(body.address)
                    lens[k] = arr.size
        return addrs, lens


def _ascii(prep: Prepared, body: object, at: int = 0) -> bool:
    """Whether the data buffers of the top-level string columns hold ASCII bytes only (then every value in
    them is valid UTF-8). The buffers lie in ``body`` from byte ``at`` on: checked when the layout was
    prepared."""
    spans = prep.str_spans
    if spans is None:
        ks = (prep.first[prep.compiled.str_nodes] + 2).tolist()
        spans = prep.str_spans = [(int(prep.offsets[k]), int(prep.offsets[k] + prep.lengths[k])) for k in ks]
    if len(spans) == 1:
        a, b = spans[0]
        if type(body) is bytes:
            return body[a + at : b + at].isascii()
        return memoryview(body)[a + at : b + at].tobytes().isascii()  # type: ignore[arg-type]
    view = memoryview(body)  # type: ignore[arg-type]
    return b"".join([view[a + at : b + at] for a, b in spans]).isascii()


def _sub_frame(
    c: Compiled, h: RecordBatchHeader, body_length: int, metadata_length: int
) -> tuple[tuple[bytes, bytes], memoryview] | None:
    """Prepared.sub for a batch whose metadata is ``metadata_length`` bytes: a RecordBatch message of the
    risky columns' nodes and buffers (Compiled.sub_nodes, sub_buffers) at their places in the same body.
    ``None`` where that message would not fit in the batch's own metadata length (a more compact writer)."""
    if h.variadic_counts is not None or h.compression is not None:
        return None
    nodes = h.nodes[c.sub_nodes]
    buffers = h.buffers[c.sub_buffers]
    template = message_template(HeaderType.RecordBatch, len(nodes), len(buffers))
    metadata = template.fill(body_length, int(h.length), nodes, buffers)
    if len(metadata) > metadata_length:
        return None
    metadata += bytes(metadata_length - len(metadata))  # after the flatbuffer: ignored by readers
    return frame_parts(metadata), memoryview(frame_head(metadata)).cast("b")


def _rest_in_shape(c: Compiled, h: RecordBatchHeader) -> bool:
    """Whether the columns outside Compiled.full_columns are as long as the batch with null counts in range
    (see Prepared.rest_checked)."""
    rest = h.nodes[c.rest_nodes]
    return bool((rest[:, 0] == h.length).all()) and bool(
        ((rest[:, 1] >= 0) & (rest[:, 1] <= rest[:, 0])).all()
    )


def _binary_spans(c: Compiled, h: RecordBatchHeader, prep: Prepared) -> npt.NDArray[np.int64] | None:
    """Prepared.spans: the compiled check's span table of the binary-like columns (Compiled.binary_nodes),
    where each is as long as the batch with its null count in range (pyarrow's cheap validation of them);
    None otherwise, or where one has no values (left to pyarrow's validation)."""
    assert c.binary_nodes is not None
    rows = []
    for node, width, utf8 in c.binary_nodes:
        length, nulls = (int(x) for x in h.nodes[node])
        if length != h.length or not 0 <= nulls <= length or length == 0:
            return None
        k = int(prep.first[node])  # its validity, offsets and data buffers: k, k + 1, k + 2
        offsets, data, bits = (int(prep.offsets[k + j]) for j in (1, 2, 0))
        rows.append((offsets, length, data, int(prep.lengths[k + 2]), width, utf8, bits, nulls))
    spans = np.array(rows, np.int64).reshape(-1, len(SPAN_FIELDS))
    spans.flags.writeable = False
    return spans


def _as_buffer(body: object) -> pa.Buffer:
    if body is None:
        return pa.py_buffer(b"")
    if isinstance(body, pa.Buffer):
        return body
    try:
        return pa.py_buffer(body)
    except TypeError:
        raise CodecError(f"message body must be bytes-like, got {type(body).__name__}") from None
